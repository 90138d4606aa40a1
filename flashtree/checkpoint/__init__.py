"""Model checkpoints: where they are (resolve), their JSON files (files), their tokenizer and chat
template (tokenizer, chat_template), their weights (weights).

Everything named here is torch-free, so the HTTP process and the training-data tools can find a
model, tokenize and render prompts without loading torch; `flashtree.checkpoint.weights` (torch)
is imported by the model loaders alone.
"""

from .chat_template import ChatTemplateError, render_chat, render_continuation
from .files import read_json, read_optional_json
from .resolve import resolve_model
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["ChatTemplateError", "Tokenizer", "load_tokenizer", "read_json", "read_optional_json",
           "render_chat", "render_continuation", "resolve_model"]
