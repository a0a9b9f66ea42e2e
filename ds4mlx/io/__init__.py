"""Model files in and out: reading GGUF and safetensors checkpoints (weights, mapped,
loader), the names and quantization formats they use, writing converted and quantized
files, the demo model, and the memory a model needs."""
