"""Text processing: CLIP's BPE tokenizer (on the `tokenizers` library)."""

from sdjax.text.tokenizer import CLIPTokenizer, PromptTruncatedWarning

__all__ = ["CLIPTokenizer", "PromptTruncatedWarning"]
