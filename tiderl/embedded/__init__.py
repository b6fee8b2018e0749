"""The embedded tiny models, the demo and CI kit behind `model.path=tiny`, not the core a user deploys
with a Hugging Face model: a tiny Qwen2 (`tiny`) or Idefics3 (`tiny_vlm`) model, the tokenizer and
chat template it is trained with (`chat_template`), its settings `model.tiny`/`model.warmstart`
(`options`, torch-free), and its cached build, warm-started on the environment's `warm_start`
(`build`). The core reaches it only through the seams tests/test_architecture.py names."""
