"""AUTOMATIC1111 "infotext": the generation parameters as text, and as the PNG `parameters` chunk that carries it.

The text format is the one the AUTOMATIC1111 web UI writes and reads (`modules/infotext_utils.py`,
`create_infotext` / `parse_generation_parameters`), also read by ComfyUI, InvokeAI and image hosts::

    a photo of an astronaut
    Negative prompt: blurry
    Steps: 20, Sampler: Euler a, CFG scale: 7.5, Seed: 0, Size: 512x512, Model: stable-diffusion-v1-5

The last line is `key: value` pairs separated by ", "; a value holding ",", ":" or a line break is JSON-quoted.
`Size` is width x height.

Escaping (`format_parameters`): AUTOMATIC1111 writes prompts as they are, so a multi-line prompt takes several
lines, and its reader moves every line that starts with "Negative prompt:" into the negative prompt. sdjax keeps
the multi-line layout (as A1111 does) but lets no prompt text change the structure: every line break (`\r\n`,
`\r`, and the separators `str.splitlines` knows, such as U+2028) is written as `\n`, and a prompt line starting
with "Negative prompt:" is written with that marker in lower case. The CLIP tokenizer collapses whitespace and
lower-cases, so the tokens (and the image) of what is read back are those of the prompt asked for. Quoted values
also escape U+0085, U+2028 and U+2029 (JSON leaves them raw).

`metadata.ImageParameters.infotext` fills the fields; `metadata.parameters_from_text` reads a request back from what
`parse_parameters` returns. Sampler names (`sampler_id`, `sampler_display_name`) and the `Model`, `Lora hashes` and
`TI hashes` values are written here too.

The family conditioning options of a request (`ImageParameters.conditioning`: the texts of the text encoders that
read their own, and zero negative embeddings) have keys of sdjax's own (`CONDITIONING_KEYS`): neither AUTOMATIC1111
nor Forge writes them (Forge reads one prompt for every encoder; SD.Next's "Prompt2" / "Negative2" are its refiner's
prompts, and its per-encoder texts live inside the prompt after "TE2:" / "TE3:"). `Prompt 2` / `Prompt 3` and
`Negative prompt 2` / `Negative prompt 3` are diffusers' `prompt_2` / `prompt_3` (Flux: T5's text; SD 3: CLIP-G's,
then T5's) and their negatives, always JSON-quoted (an empty text is a text: the encoder reads the empty prompt, not
the main prompt); `Zero negative: True` is ComfyUI's ConditioningZeroOut as the negative (zero embeddings and pooled
output). A negative handed over at a step (`metadata.NegativeSwitch`) is `Negative switch at step: k`, `Negative
prompt after switch: "..."` and these keys with " after switch".
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, PngImagePlugin

PARAMETERS_KEY = "parameters"  # the PNG text chunk keyword AUTOMATIC1111 writes and reads
EMBEDDED_MODEL_NAME = "sdjax/embedded"

# From AUTOMATIC1111's infotext_utils.py: a key starts with a word character; a value is a JSON string or runs
# to the next comma.
_PARAM_RE = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


_SIZE_RE = re.compile(r"^(\d+)x(\d+)$")

# ImageParameters.conditioning option -> its infotext key, in the order they are written (and read back)
CONDITIONING_KEYS = {
    "prompt_2": "Prompt 2",
    "prompt_3": "Prompt 3",
    "negative_prompt_2": "Negative prompt 2",
    "negative_prompt_3": "Negative prompt 3",
    "zero_negative": "Zero negative",
}
_FLAGS = ("zero_negative",)  # the options whose values are booleans (written "True", omitted when false)


class Quoted(str):
    """A value `format_parameters` always writes JSON-quoted (so that an empty text survives: A1111's reader
    unquotes `""` to the empty string, and an unquoted empty value would drop the key)."""


# ---------------------------------------------------------------------------------------------- values
def lora_hashes(named_files: Sequence[tuple[str, str | Path]], hashes: Any = None) -> str:
    """A1111's `Lora hashes` value, "name: hash12, ...", for (name as written in the prompt, file) pairs; `hashes`:
    a `models_dir.HashCache` (default: a new one)."""
    from sdjax.models_dir import HashCache

    cache = hashes or HashCache()
    clean = str.maketrans("", "", ":,")  # A1111 takes these out of the names
    return ", ".join(f"{name.translate(clean)}: {cache.network_hash(path)[:12]}" for name, path in named_files)


def ti_hashes(texts: Sequence[str], named_files: Sequence[tuple[str, str | Path]], hashes: Any = None) -> str:
    """A1111's `TI hashes` value, "name: hash12, ...", for the embeddings (trigger word, file) that `texts` use: a
    trigger word counts where it stands as a word of its own. The hash is the file's SHA-256, as A1111's."""
    from sdjax.models_dir import HashCache

    cache = hashes or HashCache()
    clean = str.maketrans("", "", ":,")
    used = [
        (name, path)
        for name, path in named_files
        if any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", t or "") for t in texts)
    ]
    return ", ".join(f"{name.translate(clean)}: {cache.sha256(path)[:12]}" for name, path in used)


# ---------------------------------------------------------------------------------------------- sampler names
def _fold(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def sampler_id(name: str) -> str:
    """The sampler registry name for any spelling the registry knows ("Euler a", "DPM++ 2M Karras",
    "euler-a" -> "euler_a", "dpmpp_2m_karras"); other names (diffusers class names, samplers sdjax lacks) unchanged.
    Requests that name one sampler differently still share batches."""
    from sdjax import samplers

    if name in samplers.SAMPLERS:
        return name
    if name in samplers.ALIASES:
        return samplers.ALIASES[name]
    key = _fold(name)
    for registry in samplers.SAMPLERS:
        if _fold(registry) == key:
            return registry
    for alias, registry in samplers.ALIASES.items():
        if _fold(alias) == key:
            return registry
    from sdjax.samplers import a1111

    label, schedule = a1111.describe(name)  # "euler a uniform" -> "Euler a Uniform"
    return f"{label} {schedule}" if schedule is not None else name


class SamplerChoiceError(ValueError):
    """An A1111 sampler + schedule pair that sdjax cannot run; `field` is "sampler" or "schedule" (which of the
    two a face names in its error: `--sampler` / `--schedule`, `sampler_name` / `scheduler`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def a1111_sampler(name: str, schedule: str = "Automatic", *, registry_fallback: bool = False) -> str:
    """The sampler an A1111 (sampler, schedule) pair means, as the one string every face and the infotext use
    (`samplers.a1111.canonical`, "Automatic" resolved: "DPM++ 2M" -> "DPM++ 2M Karras"). With
    `registry_fallback`, a registry name that is no A1111 sampler ("pndm") with "Automatic" is served as it is.
    Raises `SamplerChoiceError` naming the field at fault."""
    from sdjax.config import ConfigError
    from sdjax.samplers import a1111, available, schedules

    try:
        schedules.find_schedule(schedule)
    except ConfigError as e:
        raise SamplerChoiceError("schedule", str(e)) from None
    try:
        return sampler_id(a1111.canonical(name, schedule))
    except a1111.UnsupportedSamplerError as e:
        if registry_fallback and schedule.lower() == "automatic" and sampler_id(name) in available():
            return sampler_id(name)
        raise SamplerChoiceError("sampler", str(e)) from None
    except ConfigError as e:
        raise SamplerChoiceError("schedule", str(e)) from None


def sampler_display_name(name: str) -> str:
    """AUTOMATIC1111's name of a sampler ("euler_a" -> "Euler a"), as written in infotext; else the name."""
    from sdjax import samplers

    registry = sampler_id(name)
    for a1111, target in samplers.A1111_NAMES.items():
        if target == registry:
            return a1111
    for alias, target in samplers.ALIASES.items():  # samplers AUTOMATIC1111 lacks: an upper-case spelling
        if target == registry and alias.isupper():
            return alias
    return registry


def model_label(model: str | None) -> str:
    """The `Model:` value: a Hub id as given, a local folder by its name (like AUTOMATIC1111's checkpoint name,
    and so that the same model gives the same file bytes on any machine), the embedded model by its name."""
    from sdjax.pipelines.auto import ALIASES, EMBEDDED_MODEL

    if not model or model in ALIASES or Path(model).resolve() == Path(EMBEDDED_MODEL).resolve():
        return EMBEDDED_MODEL_NAME
    path = Path(model)
    return path.resolve().name if path.exists() else model


# ---------------------------------------------------------------------------------------------- text format
# Every line boundary of `str.splitlines`, \r\n first so that it counts as one.
_LINE_BREAK_RE = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


_NEGATIVE_MARK = "Negative prompt:"


def _prompt_lines(text: str) -> str:
    """A prompt for the infotext: line breaks as "\n", no line that reads as the negative-prompt marker."""
    lines = []
    for line in _LINE_BREAK_RE.split(text):
        body = line.lstrip()
        if body.startswith(_NEGATIVE_MARK):
            line = line[: len(line) - len(body)] + _NEGATIVE_MARK.lower() + body[len(_NEGATIVE_MARK) :]
        lines.append(line)
    return "\n".join(lines)


def _quote(value: str) -> str:
    if isinstance(value, Quoted):
        quoted = json.dumps(str(value), ensure_ascii=False)
        return quoted.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    if "," not in value and ":" not in value and not value.startswith('"') and not _LINE_BREAK_RE.search(value):
        return value
    quoted = json.dumps(value, ensure_ascii=False)
    return quoted.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def number(x: float) -> str:
    """A number as infotext writes it (a float: "7.5", "20.0")."""
    return str(float(x))


def _sampler_fields(sampler: str) -> dict[str, Any]:
    """A1111 >= 1.9 writes the sampler and its schedule apart: "Sampler: DPM++ 2M, Schedule type: Karras"."""
    from sdjax.samplers import a1111

    label, schedule = a1111.describe(sampler_display_name(sampler))
    return {"Sampler": label, "Schedule type": schedule}


def format_parameters(p: Any, extra: dict[str, Any] | None = None) -> str:
    """AUTOMATIC1111 infotext for one image (`p`: a `metadata.ImageParameters`; this module imports nothing of sdjax's
    requests). `extra` adds `key: value` pairs after the standard ones."""
    fields: dict[str, Any] = {
        "Steps": p.steps,
        **_sampler_fields(p.sampler),
        "CFG scale": number(p.guidance_scale),
        "Seed": p.seed,
        "Size": f"{p.width}x{p.height}",
        "Model hash": p.model_hash or None,
        "Model": p.model or None,
        "VAE": p.vae or None,
        "Image index": p.image_index or None,  # sdjax: the fold_in index; 0 (omitted) for CLI and server images
        **(extra or {}),
    }
    params = ", ".join(
        f"{k}: {_quote(v if isinstance(v, Quoted) else str(v))}"
        for k, v in fields.items()
        if v is not None and (v != "" or isinstance(v, Quoted))
    )
    negative = f"\nNegative prompt: {_prompt_lines(p.negative_prompt)}" if p.negative_prompt else ""
    return f"{_prompt_lines(p.prompt)}{negative}\n{params}".strip()


def conditioning_fields(conditioning: Sequence[tuple[str, Any]], suffix: str = "") -> dict[str, Any]:
    """The infotext fields of a request's family conditioning options (`CONDITIONING_KEYS` + `suffix`, in that
    order); raises ValueError for an option that has no key (it would be lost on the way back)."""
    options = dict(conditioning)
    unknown = sorted(set(options) - set(CONDITIONING_KEYS))
    if unknown:
        raise ValueError(f"conditioning options {unknown} have no infotext key; known: {list(CONDITIONING_KEYS)}")
    out: dict[str, Any] = {}
    for name, key in CONDITIONING_KEYS.items():
        if name not in options:
            continue
        value = options[name]
        if name in _FLAGS:
            out[key + suffix] = True if value else None
        else:
            out[key + suffix] = Quoted(str(value))
    return out


def conditioning_from_fields(raw: dict[str, str], suffix: str = "") -> tuple[tuple[str, Any], ...]:
    """The family conditioning options of parsed infotext (`parse_parameters`), in `CONDITIONING_KEYS`' order:
    what `conditioning_fields` wrote (with the same `suffix`)."""
    out: list[tuple[str, Any]] = []
    for name, key in CONDITIONING_KEYS.items():
        key += suffix
        if key not in raw:
            continue
        value = raw[key]
        if name in _FLAGS:
            if value not in ("True", "False"):
                raise ValueError(f"{key}: {value!r} is not True or False")
            if value == "True":
                out.append((name, True))
        else:
            out.append((name, value))
    return tuple(out)


def parse_parameters(text: str) -> dict[str, str]:
    """Infotext -> `{"Prompt": ..., "Negative prompt": ..., "Steps": "20", "Size-1": "512", "Size-2": "512", ...}`.

    Mirrors AUTOMATIC1111's `parse_generation_parameters`: lines are stripped, the negative prompt starts at a
    line beginning with `Negative prompt:`, the last line holds the parameters if it has at least three pairs.
    A `WxH` value `v` of key `K` is also split into `K-1` (width) and `K-2` (height). Values stay strings.
    A `Schedule type` (AUTOMATIC1111 1.9+, e.g. "Karras") stays a key of its own; `parameters_from_text` joins it
    to the sampler.
    """
    *lines, last = text.strip().split("\n")
    if len(_PARAM_RE.findall(last)) < 3:
        lines.append(last)
        last = ""
    prompt: list[str] = []
    negative: list[str] = []
    in_negative = False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:") :].strip()
        (negative if in_negative else prompt).append(line)
    out = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in _PARAM_RE.findall(last):
        value = _unquote(value.strip())
        out[key] = value
        m = _SIZE_RE.match(value)
        if m:
            out[f"{key}-1"], out[f"{key}-2"] = m.group(1), m.group(2)
    return out


# ---------------------------------------------------------------------------------------------- PNG files
def png_bytes(image: np.ndarray | Image.Image, parameters: str | None = None) -> bytes:
    """Encode an image as PNG with the `parameters` text chunk. Deterministic: same pixels and text, same bytes
    (PIL writes no time chunk; text that is not Latin-1 goes in an iTXt chunk as UTF-8)."""
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.ascontiguousarray(image))
    info = PngImagePlugin.PngInfo()
    if parameters is not None:
        info.add_text(PARAMETERS_KEY, parameters)
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def read_parameters(source: str | Path | bytes) -> str | None:
    """The `parameters` text of a PNG file (path or bytes), or None if it has none."""
    data = io.BytesIO(source) if isinstance(source, bytes) else source
    with Image.open(data) as im:
        im.load()
        return im.info.get(PARAMETERS_KEY) or getattr(im, "text", {}).get(PARAMETERS_KEY)
