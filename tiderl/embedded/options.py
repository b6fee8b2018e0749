"""The embedded tiny model's settings (`model.tiny.*`: its shape, `tiderl.embedded.tiny`) and its
supervised warm start (`model.warmstart.*`, `tiderl.embedded.build`), with their checks:
torch-free, so loading a config does not import the model code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.options import need, opt


@dataclass
class TinyModelConfig:
    """Shape of the embedded default model (a tiny Qwen2-architecture causal LM)."""

    vocab_size: int = opt(768, "Byte-level BPE vocabulary size of the tiny tokenizer.")
    hidden_size: int = opt(128, "Hidden width of the tiny model.")
    num_layers: int = opt(2, "Transformer layers of the tiny model.")
    num_heads: int = opt(4, "Attention heads (query).")
    num_kv_heads: int = opt(2, "Key/value heads (grouped-query attention).")
    max_positions: int = opt(512, "Longest sequence the tiny model handles.")
    image_scale_factor: int = opt(2, "Tiny vision-language model only: pixel shuffle of the connector; a 64 px picture "
                                  "of 16 px patches gives 16 / factor**2 image tokens (1, 2 or 4; 4 = one token "
                                  "holding every patch in its own slot, which the visual demo needs: docs/multimodal.md).")

    def check(self, cfg: Any) -> None:
        need(self.hidden_size % self.num_heads == 0, "hidden_size", "must be divisible by model.tiny.num_heads",
             "use e.g. 128 with 4 heads")
        need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", "must divide model.tiny.num_heads",
             "use e.g. 2 with 4 heads")
        need(self.image_scale_factor in (1, 2, 4), "image_scale_factor", f"{self.image_scale_factor} does not divide "
             "the 4x4 patches of a 64 px picture", "use 1, 2 or 4")
        need(cfg.model.path != "tiny" or self.max_positions >= cfg.env.max_total_tokens, "max_positions",
             "must be at least env.max_total_tokens", "raise model.tiny.max_positions")


@dataclass
class WarmStartConfig:
    """Supervised warm-start of the tiny model on tool-use traces that tiderl generates.

    The traces are imperfect on purpose (`relation_noise`), so RL starts from a policy that
    sometimes, not always, succeeds.
    """

    num_traces: int = opt(3000, "Oracle tool-use traces generated from the training tasks.")
    relation_noise: float = opt(0.5, "Mean rate at which the demonstrations are confused (KG: an oracle hop uses "
                                "a wrong relation; math: the confusable variant of the calculation).")
    steps: int = opt(500, "Supervised optimizer steps.")
    batch_size: int = opt(32, "Traces per supervised step.")
    lr: float = opt(3e-3, "Supervised learning rate (AdamW, cosine decay).")
    copy_check_threshold: float = opt(
        0.0, "Stop the warm start once the model copies: every copy_check_every steps, greedy answers to "
        "copy_check_size training questions about numbers kept out of the demonstrations are checked, and "
        "training stops when, for every kind of question, at least this fraction is a copied variant (the "
        "right or the confused answer), at a constant learning rate after warm-up. `steps` is then the cap (a "
        "warning if it is hit). 0 = off: exactly `steps` steps, cosine decay. Only for an environment whose warm "
        "start has a copy check.")
    copy_check_every: int = opt(25, "Supervised steps between copy checks (with copy_check_threshold > 0).")
    copy_check_size: int = opt(400, "Questions in the copy check (with copy_check_threshold > 0).")

    def check(self, cfg: Any) -> None:
        need(0 <= self.relation_noise <= 1, "relation_noise", "must be in [0, 1]", "use 0.5")
        need(0 <= self.copy_check_threshold <= 1, "copy_check_threshold", "must be in [0, 1]",
             "use 0 (off) or e.g. 0.9")
        need(self.copy_check_every >= 1, "copy_check_every", "must be >= 1", "use 25")
        need(self.copy_check_size >= 8, "copy_check_size", "must be >= 8", "use 400")
