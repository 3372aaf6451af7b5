"""MiniLM with a rewa memory at every layer: how far the sparse modes move its hidden states.

MiniLM (all-MiniLM-L6-v2, real weights, offline; benchmarks/text_data.py) reads the first
`--windows` x 510 tokens of the standard library's sources window by window (512 positions with
[CLS] and [SEP]) through `rewa.llm.EncoderMemory`: at each of its 6 layers a window attends
itself and that layer's memory of every earlier window (tests/test_llm.py checks that exact
memories give block-causal full attention). Every mode reads the same windows in one run:
`exact` (the reference), `tail` at 1 % and 2 %, and `topk` (k = 64), with the defaults a user
gets except one: an attend waits for its memory's index extension instead of reading the new
keys exactly meanwhile, so that the errors do not depend on the build thread's timing.
Recorded per mode and per layer output (0 = embeddings, 6 = final): the relative L2 error of
each token's hidden state against `exact`, median and p99 over the tokens of the windows after
`--skip` (whose memories hold at least `skip` windows), and the seconds per window.

Records `benchmarks/results/minilm_layers.json` and a PNG.

    .venv/bin/python benchmarks/minilm_layers.py
    .venv/bin/python benchmarks/minilm_layers.py --windows 16 --skip 4 --out /tmp/minilm
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.text_data import WINDOW, load_model, source_tokens
from rewa.llm import EncoderMemory, enable, local_memories

RESULTS = Path(__file__).resolve().parent / "results"
# The sparse modes wait for their index extensions (`exact_while_building=0`): by default an
# attend that comes while a memory extends its index reads the new keys exactly instead, so its
# answer depends on when the extension on the build thread ends, and so did this benchmark's
# errors from run to run (docs/benchmark-notes.md, "MiniLM's memories wait for their indexes").
DETERMINISTIC = {"exact_while_building": 0}
MODES = {
    "exact": {"mode": "exact"},
    "tail 1%": {"mode": "tail", "budget": 0.01, **DETERMINISTIC},
    "tail 2%": {"mode": "tail", "budget": 0.02, **DETERMINISTIC},
    "topk 64": {"mode": "topk", "top_k": 64, **DETERMINISTIC},
}


def read(bert, windows: list[torch.Tensor], options: dict) -> tuple[torch.Tensor, float]:
    """Hidden states `(layers + 1, tokens, hidden)` of the windows read through memories with
    `options`, and the seconds per window."""
    states = []
    start = time.perf_counter()
    with EncoderMemory(local_memories(**options)) as memory, memory.reading(), torch.no_grad():
        for window in windows:
            out = bert(input_ids=window.unsqueeze(0), output_hidden_states=True)
            states.append(torch.stack(out.hidden_states)[:, 0])
    return torch.cat(states, dim=1), (time.perf_counter() - start) / len(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--skip", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "minilm_layers")
    args = parser.parse_args()
    sentence_model = load_model()
    bert, tokenizer = sentence_model[0].auto_model, sentence_model.tokenizer
    enable(bert)
    ids, _ = source_tokens(tokenizer, WINDOW * args.windows)
    cls, sep = torch.tensor([tokenizer.cls_token_id]), torch.tensor([tokenizer.sep_token_id])
    windows = [torch.cat([cls, part, sep]) for part in ids.split(WINDOW)]
    measured = slice(args.skip * (WINDOW + 2), None)
    reference, seconds = read(bert, windows, MODES["exact"])
    records = [{"mode": "exact", "seconds_per_window": seconds}]
    for name, options in MODES.items():
        if name == "exact":
            continue
        states, seconds = read(bert, windows, options)
        error = (states - reference).norm(dim=-1) / reference.norm(dim=-1)
        error = error[:, measured]
        records.append(
            {
                "mode": name,
                "seconds_per_window": seconds,
                "median_by_layer": error.median(dim=1).values.tolist(),
                "p99_by_layer": error.quantile(0.99, dim=1).tolist(),
            }
        )
        print(records[-1], flush=True)
    result = {
        "tokens": WINDOW * args.windows,
        "windows": args.windows,
        "measured_from_window": args.skip,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"tail 1%": "tab:blue", "tail 2%": "tab:cyan", "topk 64": "tab:orange"}
    for record in result["records"][1:]:
        layers = range(1, len(record["median_by_layer"]))  # layer 0, the embeddings: no error
        colour = colours[record["mode"]]
        ax.plot(layers, record["median_by_layer"][1:], "o-", color=colour,
                label=f"{record['mode']} median")  # fmt: skip
        ax.plot(layers, record["p99_by_layer"][1:], "s--", color=colour, alpha=0.6,
                label=f"{record['mode']} p99")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("hidden state after layer")
    ax.set_ylabel("relative error against exact memories")
    ax.set_title(f"MiniLM, {result['tokens']} tokens read in windows of 512")
    ax.legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
