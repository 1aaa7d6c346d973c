"""The generation core: one pure denoising loop (`loop`), conditioning per model family (`families`), tasks that
prepare the loop's start and hooks (`tasks`), and the `Generator` that compiles and runs the whole program on a
mesh with a bounded cache of executables."""

from sdjax.core.generator import Cancelled, Generator, ProgramCache, ProgramSpec, program
from sdjax.core.loop import Hook, denoise

__all__ = ["Cancelled", "Generator", "Hook", "ProgramCache", "ProgramSpec", "denoise", "program"]
