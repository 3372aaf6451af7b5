"""Decoding at a 128k-token context with rewa as the model's memory (rewa.llm, docs/llm.md).

1. One layer's decode step: 32 query heads over 8 key/value heads, head_dim 128, 131072 tokens
   in the cache, the defaults a user gets (`RewaCache`: 4 sinks, a 512-token window, spills of
   256; a tail memory at the default budget of 2 %, and in process also at 1 %). A step is what
   the model does per layer and token: `update` with the new key and value, then the attention
   of the new query (the local part and the memory, merged). Timed per step, interleaved with
   dense SDPA over the same keys (all of them), for the in-process memory (`local_memories`)
   and the HTTP memory (`remote_memories`, a `rewa serve` subprocess on this machine, embedded
   store). Keys are topic-clustered like benchmarks/data.py's `clustered` (one component per
   256 keys) and each step's query is a fresh draw from the mixture (sharp: a few topics hold
   most of its attention); the error of each step's output against SDPA's is recorded. The
   in-process memory is also timed with diffuse queries (standard normal, unrelated to the
   topics: attention spread over the whole context, so the tail estimate's value shift reads
   most clusters' statistics), as heads of real models are both. The first step spills the
   prompt into the memory, which indexes it (the service in the background); the timed steps
   begin once the index is built (`wait_for_index`, recorded apart), as a pipeline's would.
2. Tokens per second of a small Llama (2 layers, the same heads, hidden size 512) generating at a
   131072-token context: its caches are filled with the same synthetic keys (a CPU cannot run a
   128k prefill through the model), then it decodes `--new-tokens` tokens greedily with
   `RewaCache` (in-process tail memory) and with transformers' `DynamicCache` and SDPA.

Records `benchmarks/results/llm_decode.json` and a PNG.

    .venv/bin/python benchmarks/llm_decode.py
    .venv/bin/python benchmarks/llm_decode.py --tokens 32768 --steps 50 --out /tmp/llm
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from rewa.clients import Client
from rewa.llm import RewaCache, enable, local_memories, remote_memories
from rewa.llm.transformers_memory import MemoryLayer
from rewa.service.settings import EXACT_WHILE_BUILDING
from tests.service_support import Server

RESULTS = Path(__file__).resolve().parent / "results"
Q_HEADS, KV_HEADS, DIM = 32, 8, 128
QUERY_SCALE = 4.0  # the clustered data set's temperature


class Mixture:
    """Topic-clustered keys per kv head; queries are fresh draws, scaled."""

    def __init__(self, tokens: int, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.centres = torch.randn(KV_HEADS, max(1, tokens // 256), DIM, generator=self.generator)

    def draw(self, heads: int, n: int) -> torch.Tensor:
        kv = torch.arange(heads) * KV_HEADS // heads
        labels = torch.randint(self.centres.shape[1], (heads, n), generator=self.generator)
        points = self.centres[kv.unsqueeze(1), labels]
        return points + 0.6 * torch.randn(points.shape, generator=self.generator)

    def values(self, n: int) -> torch.Tensor:
        return torch.randn(KV_HEADS, n, DIM, generator=self.generator)


def sdpa_step(query, keys, values) -> torch.Tensor:
    """Dense attention of `(1, 32, 1, 128)` over `(1, 8, n, 128)`: `(1, 1, 32, 128)`. The
    query heads of each group are that kv head's rows (no copy of the keys, unlike
    `enable_gqa`, which repeats them: 2x slower here)."""
    grouped = query.reshape(1, KV_HEADS, Q_HEADS // KV_HEADS, DIM)
    out = F.scaled_dot_product_attention(grouped, keys, values)
    return out.reshape(1, Q_HEADS, 1, DIM).transpose(1, 2)


def layer_steps(memories, tokens: int, steps: int, budget: float, diffuse: bool = False) -> dict:
    """Decode `steps` tokens through one `MemoryLayer` and, interleaved, dense SDPA; `diffuse`:
    standard normal queries instead of draws from the keys' mixture."""
    mixture = Mixture(tokens)
    keys = mixture.draw(KV_HEADS, tokens + steps).unsqueeze(0)
    values = mixture.values(tokens + steps).unsqueeze(0)
    if diffuse:
        queries = torch.randn(Q_HEADS, steps + 1, DIM, generator=mixture.generator)
    else:
        queries = mixture.draw(Q_HEADS, steps + 1) * QUERY_SCALE
    layer = MemoryLayer(0, memories, window=512, sinks=4, spill=256)
    scaling = DIM**-0.5
    start = time.perf_counter()
    layer.update(keys[:, :, :tokens], values[:, :, :tokens])
    # The first query spills everything before the window and builds the memory's index (in
    # process; the service builds it in the background, and the steps wait for it as a
    # pipeline would after its prompt: docs/llm.md, "Waiting for the index").
    layer.attend(queries[:, :1].unsqueeze(0), scaling)
    first = time.perf_counter() - start
    layer.wait_for_index()
    index_wait = time.perf_counter() - start - first
    rewa_ms, sdpa_ms, errors = [], [], []
    for step in range(steps):
        n = tokens + step + 1
        new = slice(n - 1, n)
        query = queries[:, step + 1 : step + 2].unsqueeze(0)
        t0 = time.perf_counter()
        layer.update(keys[:, :, new], values[:, :, new])
        out = layer.attend(query, scaling)
        t1 = time.perf_counter()
        dense = sdpa_step(query, keys[:, :, :n], values[:, :, :n])
        t2 = time.perf_counter()
        rewa_ms.append((t1 - t0) * 1e3)
        sdpa_ms.append((t2 - t1) * 1e3)
        errors.append(((out - dense).norm() / dense.norm()).item())
    layer.close()
    return {
        "first_step_s": first,
        "index_wait_s": index_wait,
        "rewa_p50_ms": statistics.median(rewa_ms),
        "rewa_mean_ms": statistics.fmean(rewa_ms),
        "rewa_p90_ms": statistics.quantiles(rewa_ms, n=10)[-1],
        "sdpa_p50_ms": statistics.median(sdpa_ms),
        "speedup_p50": statistics.median(sdpa_ms) / statistics.median(rewa_ms),
        "relative_error_p50": statistics.median(errors),
        "relative_error_max": max(errors),
        "budget": budget,
        "queries": "diffuse" if diffuse else "sharp",
    }


def small_llama(tokens: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=DIM,
        max_position_embeddings=2 * tokens,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def fill(cache, model, mixture: Mixture, tokens: int) -> None:
    """A prompt's keys and values put straight into each layer of the cache, as a forward pass
    would have cached them. Through the layers, not `cache.update`: a `RewaCache` refuses an
    update that no attention of the model read (its check that the model runs rewa attention)."""
    for layer in range(model.config.num_hidden_layers):
        keys = mixture.draw(KV_HEADS, tokens).unsqueeze(0)
        cache.layers[layer].update(keys, mixture.values(tokens).unsqueeze(0))


def generation(tokens: int, new_tokens: int, budget: float) -> dict:
    """Greedy decoding at a `tokens` context: tokens/s with rewa memory and with full attention."""
    reference = small_llama(tokens)
    reference.set_attn_implementation("sdpa")
    model = enable(small_llama(tokens))
    prompt = torch.tensor([[1]])
    rates = {}
    for name in ("full", "rewa"):
        mixture = Mixture(tokens, seed=1)
        if name == "full":
            cache, runner = DynamicCache(config=reference.config), reference
        else:
            cache = RewaCache(model.config, local_memories(mode="tail", budget=budget))
            runner = model
        fill(cache, runner, mixture, tokens)
        with torch.no_grad():
            # One token first: the rewa memory spills and builds here (reported apart).
            start = time.perf_counter()
            out = runner(prompt, past_key_values=cache, use_cache=True)
            first = time.perf_counter() - start
            token = out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(new_tokens):
                out = runner(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            seconds = time.perf_counter() - start
        rates[name] = {"tokens_per_s": new_tokens / seconds, "first_token_s": first}
        if name == "rewa":
            cache.close()
        del cache
    rates["speedup"] = rates["rewa"]["tokens_per_s"] / rates["full"]["tokens_per_s"]
    return rates


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    layer = result["layer_step"]
    budget = layer["local"]["budget"]
    steps = [(f"local\nsharp {budget:.0%}", layer["local"], "tab:blue")]
    if "layer_step_low_budget" in result:
        low = result["layer_step_low_budget"]
        steps.append((f"local\nsharp {low['budget']:.0%}", low, "tab:green"))
    if "layer_step_diffuse" in result:
        diffuse = result["layer_step_diffuse"]
        steps.append((f"local\ndiffuse {diffuse['budget']:.0%}", diffuse, "tab:cyan"))
    if "http" in layer:
        steps.append((f"HTTP\nsharp {budget:.0%}", layer["http"], "tab:orange"))
    steps.append(("dense SDPA", {"rewa_p50_ms": layer["local"]["sdpa_p50_ms"]}, "tab:gray"))
    left.bar([label for label, *_ in steps], [s["rewa_p50_ms"] for _, s, _ in steps],
             color=[color for *_, color in steps])  # fmt: skip
    for target, label, style in ((10, "target in process, 10 ms", ":"),
                                 (25, "target over HTTP, 25 ms", "--")):  # fmt: skip
        left.axhline(target, color="black", linestyle=style, linewidth=1, label=label)
    left.legend(loc="upper left", fontsize=8)
    left.set_ylabel("ms per layer per token (median)")
    left.set_title(f"one layer's decode step at {result['tokens']} tokens", fontsize=10)
    if "generation" in result:
        rates = result["generation"]
        right.bar(["rewa (tail)", "full attention"],
                  [rates["rewa"]["tokens_per_s"], rates["full"]["tokens_per_s"]],
                  color=["tab:blue", "tab:gray"])  # fmt: skip
        right.set_ylabel("tokens / s")
        right.set_title("2-layer Llama generating at that context", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.02)
    parser.add_argument("--low-budget", type=float, default=0.01)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "llm_decode")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.with_suffix(".json").read_text()), args.out.with_suffix(".png"))
        return
    result = {"tokens": args.tokens, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
              "threads": torch.get_num_threads(), "layer_step": {}}  # fmt: skip
    memories = local_memories(mode="tail", budget=args.budget)
    result["layer_step"]["local"] = layer_steps(memories, args.tokens, args.steps, args.budget)
    print("local", result["layer_step"]["local"], flush=True)
    low = local_memories(mode="tail", budget=args.low_budget)
    result["layer_step_low_budget"] = layer_steps(low, args.tokens, args.steps, args.low_budget)
    print("local, low budget", result["layer_step_low_budget"], flush=True)
    memories = local_memories(mode="tail", budget=args.budget)
    diffuse = layer_steps(memories, args.tokens, args.steps, args.budget, diffuse=True)
    result["layer_step_diffuse"] = diffuse
    print("local, diffuse queries", diffuse, flush=True)
    if not args.no_http:
        # The service's defaults (the test helper's attends would wait for every build).
        server = Server(exact_while_building=EXACT_WHILE_BUILDING).start()
        try:
            with Client(server.url, timeout=600) as client:
                memories = remote_memories(client, mode="tail", budget=args.budget)
                steps = layer_steps(memories, args.tokens, args.steps, args.budget)
                result["layer_step"]["http"] = steps
                print("http", steps, flush=True)
        finally:
            server.kill()
    result["generation"] = generation(args.tokens, args.new_tokens, args.budget)
    result["generation"]["new_tokens"] = args.new_tokens
    print("generation", result["generation"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
