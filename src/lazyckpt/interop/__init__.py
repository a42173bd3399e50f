"""Other formats: convert (torch.save, safetensors, DCP <-> lazyckpt), Hugging Face
model directories, and the reader side of DCP directories written by lazyckpt."""
