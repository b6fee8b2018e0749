"""Models: Hugging Face causal and vision-language models as they are (the embedded tiny default: tiderl/embedded/)."""
