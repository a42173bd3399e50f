"""lazyckpt.storage.s3layout."""
