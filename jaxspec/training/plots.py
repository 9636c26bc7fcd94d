"""Loss curves as PNG (matplotlib is optional: without it the curves stay in the metrics JSON)."""

from __future__ import annotations

from pathlib import Path


def plot_curves(path: str | Path, title: str, series: dict[str, tuple[list, list]], ylabel: str = "loss",
                logy: bool = False) -> bool:
    """`series`: label -> (steps, values). Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: {path} not drawn")
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
