"""The PNGs of `gpt2 inspect`, drawn with matplotlib's Agg backend (no display needed) from the report's numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never a window, works on a server without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

TOKEN_LABELS = 40  # above this many tokens, axes are numbered instead of labelled with the tokens


def show(text: str) -> str:
    """A token as a readable label: whitespace made visible, matplotlib's mathtext '$' escaped."""
    return text.replace("\n", "\\n").replace("\t", "\\t").replace("$", r"\$") or "''"


def axis_labels(tokens: list[str]) -> list[str]:
    return [show(t) for t in tokens] if len(tokens) <= TOKEN_LABELS else [str(i) for i in range(len(tokens))]


def save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def attention_grid(report: dict[str, Any], path: Path) -> Path:
    """One heatmap per (layer, head): rows the chosen layers, columns the heads; query down, key across."""
    att, tokens = report["attention"], report["tokens"]
    layers, n_head, T = att["layers"], report["model"]["n_head"], len(tokens)
    cell = 1.7 if T <= 16 else 2.2
    fig, axes = plt.subplots(len(layers), n_head, figsize=(cell * n_head, cell * len(layers)), squeeze=False)
    labels = axis_labels(tokens)
    for r, layer in enumerate(layers):
        for h in range(n_head):
            ax = axes[r][h]
            ax.imshow(np.array(att["patterns"][r][h]), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"L{layer}H{h}", fontsize=8)
            small = T <= 16
            ax.set_xticks(range(T) if small and r == len(layers) - 1 else [])
            ax.set_yticks(range(T) if small and h == 0 else [])
            if small:
                ax.set_xticklabels(labels if r == len(layers) - 1 else [], rotation=90, fontsize=6)
                ax.set_yticklabels(labels if h == 0 else [], fontsize=6)
    fig.suptitle("Attention patterns (row: query token, column: key token; darker = more attention)", fontsize=10)
    return save(fig, path)


def logit_lens_map(report: dict[str, Any], path: Path) -> Path:
    """Layer x position: the top-1 token written in each cell, coloured by its probability."""
    lens, tokens = report["logit_lens"], report["tokens"]
    probs = np.array([[row[0] for row in layer] for layer in lens["top_probs"]])  # [L + 1, T]
    T = len(tokens)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.85 * T + 1.5), 0.45 * len(lens["labels"]) + 1.5))
    im = ax.imshow(probs, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    for li, layer in enumerate(lens["top_tokens"]):
        for t, row in enumerate(layer):
            ax.text(t, li, show(row[0])[:10], ha="center", va="center", fontsize=6.5,
                    color="black" if probs[li, t] > 0.6 else "white")
    ax.set_yticks(range(len(lens["labels"])), lens["labels"], fontsize=8)
    ax.set_xticks(range(T), axis_labels(tokens), rotation=90, fontsize=7)
    ax.set_xlabel("prompt token (the lens predicts the token after it)")
    fig.colorbar(im, ax=ax, label="probability of the top-1 token", shrink=0.8)
    ax.set_title("Logit lens: ln_f (with each layer's own statistics) and the unembedding after every block", fontsize=10)
    return save(fig, path)


def dla_map(report: dict[str, Any], path: Path) -> Path:
    """Layer x (heads, MLP): each component's direct contribution to the target's logit at the last position."""
    dla, n_head = report["dla"], report["model"]["n_head"]
    values = np.array([heads + [mlp] for heads, mlp in zip(dla["per_head"], dla["mlp"])])  # [L, nh + 1]
    bound = max(float(np.abs(values).max()), 1e-6)
    fig, ax = plt.subplots(figsize=(0.7 * (n_head + 1) + 2.5, 0.45 * len(values) + 1.6))
    im = ax.imshow(values, cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -bound, bound), aspect="auto", interpolation="nearest")
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6.5, color="white" if abs(v) > 0.6 * bound else "black")
    ax.set_xticks(range(n_head + 1), [f"H{h}" for h in range(n_head)] + ["MLP"], fontsize=8)
    ax.set_yticks(range(len(values)), [f"L{i}" for i in range(len(values))], fontsize=8)
    fig.colorbar(im, ax=ax, label="logit contribution", shrink=0.8)
    target = report["target"]
    ax.set_title(f"Direct logit attribution to {show(target['text'])!r} (logit {dla['logit']:.3g})", fontsize=10)
    return save(fig, path)


def attribution_strip(report: dict[str, Any], path: Path) -> Path:
    """The prompt, token by token, coloured by each method's attribution (red for, blue against)."""
    tokens, att = report["tokens"], report["attribution"]
    rows = [("gradient x input", att["grad_x_input"]), (f"integrated gradients ({att['ig_steps']} steps)", att["integrated_gradients"])]
    width = sum(max(2, len(show(t))) for t in tokens) * 0.11 + 1.0
    fig, axes = plt.subplots(len(rows), 1, figsize=(min(max(width, 6.0), 30.0), 1.1 * len(rows) + 0.6), squeeze=False)
    cmap = plt.get_cmap("RdBu_r")
    for ax, (title, values) in zip(axes[:, 0], rows):
        bound = max(max(abs(v) for v in values), 1e-9)
        x = 0.0
        total = sum(max(2, len(show(t))) + 1 for t in tokens)
        for t, v in zip(tokens, values):
            w = (max(2, len(show(t))) + 1) / total
            ax.add_patch(plt.Rectangle((x, 0.15), w * 0.96, 0.7, color=cmap(0.5 + 0.5 * v / bound)))
            ax.text(x + w * 0.48, 0.5, show(t), ha="center", va="center", fontsize=7)
            x += w
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.axis("off")
        ax.set_title(title, fontsize=8, loc="left")
    target = report["target"]
    fig.suptitle(f"Which prompt tokens raise log p({show(target['text'])!r}) (red) or lower it (blue)", fontsize=10, y=1.0)
    fig.subplots_adjust(top=0.8, hspace=0.6)
    return save(fig, path)


def head_score_maps(report: dict[str, Any], path: Path) -> Path:
    """The three head detectors side by side, layer x head."""
    scores = report["head_scores"]
    fig, axes = plt.subplots(1, len(scores), figsize=(3.3 * len(scores), 0.4 * report["model"]["n_layer"] + 1.8), squeeze=False)
    for ax, (kind, values) in zip(axes[0], scores.items()):
        m = np.array(values)
        ax.imshow(m, cmap="Greens", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        for (i, j), v in np.ndenumerate(m):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="white" if v > 0.6 else "black")
        ax.set_title(kind.replace("_", " "), fontsize=9)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.set_xticks(range(m.shape[1]))
        ax.set_yticks(range(m.shape[0]))
        ax.tick_params(labelsize=7)
    fig.suptitle("Head detectors: mean attention to where such a head looks, on random repeated token runs", fontsize=10)
    return save(fig, path)


PICTURES = {"attention.png": attention_grid, "logit_lens.png": logit_lens_map, "dla.png": dla_map,
            "attribution.png": attribution_strip, "head_scores.png": head_score_maps}
