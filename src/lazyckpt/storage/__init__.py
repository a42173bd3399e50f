"""Where bytes live, behind one interface (base: the Store ABC and the byte and
directory protocols; stores.for_path: which store a path belongs to): the local
file system (fileio: O_DIRECT or buffered; iomode: which mode each transfer takes; layout: a
Checkpointer directory committed by rename; localstore) and S3-compatible
object stores (s3: the client, multipart and ranged reads; s3layout: a
Checkpointer directory committed by a manifest object; s3store)."""
