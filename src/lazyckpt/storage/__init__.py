"""Where bytes live: local files (fileio: O_DIRECT or buffered; iomode: the probe),
S3-compatible object stores (s3), and a Checkpointer directory on each (layout,
s3layout: listing, commit by rename or manifest object, leases, retention)."""
