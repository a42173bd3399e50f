"""The load side: what a path designates (resolve), opening and reading a data
file (reader), building the state (loader), loading in the background (restore),
and checking every checksum (verify)."""
