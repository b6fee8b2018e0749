"""The LoRA engine on a bf16 base: adapters applied unmerged (what `LoraTorchEngine` does) against
adapters merged into the bf16 weights (fp32 sum, rounded once: what it did before), measured on a
real model.

Both start from the same bf16 base with LoRA r=16 on every linear layer. The adapters are set,
not trained: A keeps peft's random initialisation, and B is random, scaled so that the median
|dW| / |W| over the adapted weights is `--update` (default 1.6e-4, what 9 actor steps at lr 1e-5
gave Qwen2.5-Coder-0.5B on the AgentBench-DB recipe; docs/real_models.md). The completions are
sampled from the unmerged engine at T = 1 on fixed chat prompts; every figure is teacher-forced on
those completion tokens:

- effect error: how well each arithmetic resolves the update's effect on log-probs. The RMS of
  (log p_X - log p_base, both in bf16) minus (log p_adapted - log p_base, both in fp32: the exact
  effect), relative to the RMS of the exact effect. 0 is exact; 1 or more means bf16 rounding
  hides the update.
- gap to the trainer: mean and largest |log p_X - log p_trainer| per token, where the trainer is
  peft's forward in bf16 (what SAO's ratio is computed with); and the share of tokens whose ratio
  leaves SAO's default bounds (0.7, 6.0), which its mask would drop.
- decode tokens/s of each engine (16 rows, 64 new tokens, alternated repeats).

    .venv/bin/python benchmarks/lora_engine.py --model ~/.cache/tiderl/models/qwen2.5-coder-0.5b-instruct
    .venv/bin/python benchmarks/lora_engine.py --quick        # a tiny random model (smoke test)

What it does not show: trained adapters (gradient-aligned updates may survive a merge in other
proportions than random ones), or any effect on learning.

Last line: the mean gap to the trainer's log-probs and tokens/s, unmerged vs merged, and the speed ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tiderl.rollout.base import SamplingParams  # noqa: E402
from tiderl.rollout.lora import LoraTorchEngine  # noqa: E402
from tiderl.rollout.torch_engine import TorchEngine  # noqa: E402
from tiderl.train.lora import apply_lora, policy_state  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTIONS = [
    "Write a SQL query that counts the rows of the table `orders` per customer.",
    "Which tool would you call to list the tables of a database, and with which arguments?",
    "Explain in two sentences what a LEFT JOIN returns.",
    "Give the SQL to add a column `email` of type TEXT to the table `users`.",
    "Who directed the film that starred the lead actor of Casablanca?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What does GROUP BY do when a column is not aggregated?",
    "List three ways to speed up a slow SQL query.",
]


def load(args: argparse.Namespace):
    if args.quick:
        from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer

        tokenizer = train_tokenizer(QUESTIONS * 4, vocab_size=400)
        model = init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2,
                                                  num_kv_heads=1, max_position_embeddings=512), seed=0)
        with torch.no_grad():
            model.model.norm.weight.mul_(8.0)
        prompts = [tokenizer.encode(q) for q in QUESTIONS]
        return model, tokenizer, prompts
    from tiderl.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype="float32")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    return model, tokenizer, [list(p) for p in prompts]


def set_adapters(policy, update: float, seed: int) -> dict[str, torch.Tensor]:
    """Random B (A as peft initialised it), scaled so that the median |dW| / |W| is `update`."""
    g = torch.Generator().manual_seed(seed)
    state = policy_state(policy)
    adapters = {k: (torch.randn(v.shape, generator=g) if ".lora_B." in k else v.float()) for k, v in state.items()}
    ratios = []
    for name, module in policy.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a, b = adapters[f"{name}.lora_A.default.weight"], adapters[f"{name}.lora_B.default.weight"]
            dw = (b @ a) * module.scaling["default"]
            w = module.base_layer.weight.float()
            ratios.append(((dw.abs() / w.abs().clamp_min(1e-12)).flatten()[::97]))
    scale = update / torch.cat(ratios).median().item()
    adapters = {k: (v * scale if ".lora_B." in k else v) for k, v in adapters.items()}
    policy.load_state_dict(adapters, strict=False)
    return adapters


def merged_bf16(policy) -> torch.nn.Module:
    """The plain bf16 model with each adapter merged in fp32 and rounded once."""
    model = copy.deepcopy(policy).unload()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, module in policy.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                plain = modules[name.removeprefix("base_model.model.")]
                dw = (module.lora_B["default"].weight.float() @ module.lora_A["default"].weight.float())
                plain.weight.copy_((plain.weight.float() + dw * module.scaling["default"]).to(plain.weight.dtype))
    return model


def token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def decode_speed(engine, prompts: list[list[int]], rows: int, new_tokens: int) -> float:
    batch = [prompts[i % len(prompts)] for i in range(rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    start = time.perf_counter()
    out = engine.generate(batch, params)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path.home() / ".cache/tiderl/models/qwen2.5-coder-0.5b-instruct"))
    parser.add_argument("--update", type=float, nargs="+", default=[1.6e-4, 1.6e-3])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny random model, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rows, args.new_tokens, args.update = 1, 4, 16, [1e-3]
    elif not Path(args.model).is_dir():
        sys.exit(f"--model {args.model} is not a directory: fetch it with "
                 "`tiderl models fetch qwen2.5-coder-0.5b-instruct`, or run with --quick")

    torch.manual_seed(0)  # peft draws each adapter's A from torch's global generator
    fp32_base, tokenizer, prompts = load(args)
    print(f"model: {'tiny (quick)' if args.quick else args.model}; {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    bf16_base = copy.deepcopy(fp32_base).to(torch.bfloat16)
    exact = apply_lora(fp32_base, r=16, alpha=32.0, target_modules=TARGETS)  # fp32: the update's exact effect
    results = []
    for update in args.update:
        policy = apply_lora(copy.deepcopy(bf16_base), r=16, alpha=32.0, target_modules=TARGETS)
        adapters = set_adapters(policy, update, seed=0)
        unmerged = LoraTorchEngine(policy, tokenizer, seed=1, max_batch_size=args.rows)
        unmerged.update_weights(adapters, version=1)
        merged_model = merged_bf16(policy)
        merged = TorchEngine(merged_model, tokenizer, seed=1, max_batch_size=args.rows)
        completions = unmerged.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=48))
        exact.load_state_dict(adapters, strict=False)
        delta_true, delta = [], {"unmerged": [], "merged": []}
        gaps = {"unmerged": [], "merged": []}
        for prompt, completion in zip(prompts, completions):
            tokens = completion.token_ids
            with exact.disable_adapter():
                base32 = token_logprobs(exact, prompt, tokens)
            with policy.disable_adapter():
                base16 = token_logprobs(policy, prompt, tokens)
            delta_true.append(token_logprobs(exact, prompt, tokens) - base32)
            trainer = token_logprobs(policy, prompt, tokens)
            for name, model in (("unmerged", unmerged.model), ("merged", merged_model)):
                scored = token_logprobs(model, prompt, tokens)
                delta[name].append(scored - base16)
                gaps[name].append(scored - trainer)
        truth = torch.cat(delta_true)
        row = {"update": update, "tokens": truth.numel(), "effect": truth.abs().mean().item(),
               "effect_max": truth.abs().max().item()}
        for name in ("unmerged", "merged"):
            d, gap = torch.cat(delta[name]), torch.cat(gaps[name])
            row[f"{name}_error"] = ((d - truth).pow(2).mean().sqrt() / truth.pow(2).mean().sqrt()).item()
            row[f"{name}_gap_mean"] = gap.abs().mean().item()
            row[f"{name}_gap_max"] = gap.abs().max().item()
            ratio = gap.exp()
            row[f"{name}_masked"] = ((ratio <= 0.7) | (ratio >= 6.0)).float().mean().item()
        speeds = {"unmerged": [], "merged": []}
        decode_speed(unmerged, prompts, args.rows, 8)  # warm-up
        decode_speed(merged, prompts, args.rows, 8)
        for _ in range(args.repeats):
            for name, engine in (("unmerged", unmerged), ("merged", merged)):
                speeds[name].append(decode_speed(engine, prompts, args.rows, args.new_tokens))
        for name in speeds:
            row[f"{name}_tok_s"] = statistics.median(speeds[name])
            row[f"{name}_tok_s_range"] = (min(speeds[name]), max(speeds[name]))
        results.append(row)
        print(f"\nmedian |dW|/|W| = {update:.2g}: {row['tokens']} completion tokens, exact effect of the update "
              f"{row['effect']:.3g} nats/token on average, {row['effect_max']:.3g} at most")
        print("| engine | effect error | mean / max gap to trainer (nats) | tokens outside SAO's bounds | "
              "decode tok/s (median, range) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name in ("unmerged", "merged"):
            lo, hi = row[f"{name}_tok_s_range"]
            print(f"| {name} | {row[f'{name}_error']:.2f} | {row[f'{name}_gap_mean']:.2e} / "
                  f"{row[f'{name}_gap_max']:.2e} | {row[f'{name}_masked']:.2%} | "
                  f"{row[f'{name}_tok_s']:.1f} ({lo:.1f}-{hi:.1f}) |")
        del unmerged, merged, merged_model, policy
    first = results[0]
    print(f"update {first['update']:.2g}: mean gap to the trainer unmerged {first['unmerged_gap_mean']:.2e} vs "
          f"merged {first['merged_gap_mean']:.2e} nats/token; decode tok/s unmerged {first['unmerged_tok_s']:.1f} vs merged "
          f"{first['merged_tok_s']:.1f} (ratio {first['unmerged_tok_s'] / first['merged_tok_s']:.2f}x)")


if __name__ == "__main__":
    main()
