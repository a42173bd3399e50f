"""lazyckpt.formats."""
