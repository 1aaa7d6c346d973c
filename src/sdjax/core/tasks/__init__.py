"""Tasks: what turns a request into the loop's initial latents and hooks. One module per task; a new task is one
new file and one line in `TASKS`."""

from sdjax.core.tasks import img2img, inpaint, txt2img
from sdjax.core.tasks.base import Context, TaskRequest, TaskSpec, window
from sdjax.core.tasks.img2img import Img2Img
from sdjax.core.tasks.inpaint import Inpaint
from sdjax.core.tasks.txt2img import Txt2Img

TASKS = {"txt2img": Txt2Img, "img2img": Img2Img, "inpaint": Inpaint}

__all__ = [
    "TASKS",
    "Context",
    "Img2Img",
    "Inpaint",
    "TaskRequest",
    "TaskSpec",
    "Txt2Img",
    "img2img",
    "inpaint",
    "txt2img",
    "window",
]
