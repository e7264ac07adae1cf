"""Quality and speed benchmarks: perplexity/KL/top-1 through the paged caches, decode speed."""
