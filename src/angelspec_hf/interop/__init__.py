"""Reading and writing other projects' drafter formats."""

from .angelspec import export_angelspec, load_angelspec
from .angelspec_mtp import export_angelspec_mtp, load_angelspec_mtp
from .dflash import export_dflash, export_transformers_dflash, load_dflash
from .eagle3 import export_eagle3, load_eagle3

__all__ = ["export_angelspec", "export_angelspec_mtp", "export_dflash", "export_eagle3", "export_transformers_dflash",
           "load_angelspec", "load_angelspec_mtp", "load_dflash", "load_eagle3"]
