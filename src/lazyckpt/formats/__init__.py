"""The on-disk formats, pure (no I/O): the data file (datafile), the step manifest,
the names of files and directories, DTensor placement. See docs/FORMAT.md."""
