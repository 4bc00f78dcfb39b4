"""The plots' setup: matplotlib without a display."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None without matplotlib (the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, path, dpi: int = 100) -> bool:
    """Lays `fig` out tightly, writes it to `path` and closes it; True (the plot was drawn)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True
