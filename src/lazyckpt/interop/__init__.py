"""lazyckpt.interop."""
