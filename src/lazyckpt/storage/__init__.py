"""lazyckpt.storage."""
