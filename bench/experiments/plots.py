"""plots.py - what the experiment scripts' plotting share (on PYTHONPATH through lib.sh)."""


def save_png(fig, path):
    """Writes fig to path at 72 dpi, then, where Pillow is installed, as a 64-colour palette
    image, which keeps the PNGs committed to docs/ small."""
    fig.savefig(path, dpi=72)
    try:
        from PIL import Image
    except ImportError:
        return
    Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)
