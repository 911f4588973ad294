"""Reading and writing other projects' drafter formats."""

from .dflash import export_dflash, load_dflash

__all__ = ["export_dflash", "load_dflash"]
