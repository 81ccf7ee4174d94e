"""``--plot``: a PNG bar chart of each peer's ratio to torch (needs matplotlib)."""

from __future__ import annotations

from shmloader.bench.results import ConfigResult


def write_plot(path: str, results: list[ConfigResult]) -> str:
    """A PNG bar chart of each peer's ratio to torch; returns a message for the user."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed, so no chart was drawn (pip install matplotlib)."
    labels = [r.config.label for r in results]
    peers = ["shmloader", "shmloader w0", "copy ceiling shm", "copy ceiling"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4.5))
    width = 0.8 / len(peers)
    for j, peer in enumerate(peers):
        vals = []
        for res in results:
            row = res.row(peer) or (res.row("shmloader+ImageFolder") if peer == "shmloader" else None)
            vals.append(row.ratio_to_torch if row and row.ratio_to_torch else 0.0)
        ax.bar([i + (j - 1.5) * width for i in range(len(labels))], vals, width, label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8, label="torch DataLoader")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("batches/s relative to torch DataLoader (log)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart written to {path}"
