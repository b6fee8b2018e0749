"""Models: Hugging Face causal LMs as they are, plus the embedded tiny default."""
