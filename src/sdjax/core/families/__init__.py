"""Conditioning per model family: text encoders (and SDXL's micro-conditioning) -> the UNet's context and
added inputs. Each family is one small module with the same interface (`tokenize`, `host_inputs`, `encode`)."""

from sdjax.core.families.sd import SDConditioning
from sdjax.core.families.sdxl import SDXLConditioning

__all__ = ["SDConditioning", "SDXLConditioning"]
