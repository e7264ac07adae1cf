"""Model loading and description: HF directories, GGUF files and built-in configs."""
