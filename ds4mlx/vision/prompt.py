"""A rendered prompt with image markers -> the job's token ids and image spans.

Every parsed image must land in the prompt: a marker the family template did not
render (or an image while no encoder is loaded) is a refusal, never a silent drop.
"""

from __future__ import annotations

from ..chat import images as chat_images
from .encoder import tokenize

ERR_NO_ENCODER = "the loaded model has no vision encoder: image input needs a server started with --vision"
ERR_IMAGE_HISTORY = "a request with images must replay its full history (no live continuation)"
ERR_NOT_PLACED = "an image could not be placed in the prompt (images go in user messages and tool results)"


class ImagePromptError(chat_images.ImageError):
    """An image the prompt cannot take (the request's 400, as a bad image is)."""


def attach(job, engine, images: list) -> None:
    """Set job.prompt_ids / images / image_inputs for a job whose prompt_text holds the
    markers of `images` (chat.images.ImageInput); no-op without images."""
    if not images:
        return
    if getattr(engine, "vision", None) is None:
        raise ImagePromptError(ERR_NO_ENCODER)
    chat_images.check_count(len(images))
    ids, spans = tokenize(engine.tokenizer, job.prompt_text, images, engine.vision)
    placed = [p for p in chat_images.split_markers(job.prompt_text, images) if not isinstance(p, str)]
    if {id(p) for p in placed} != {id(im) for im in images}:
        raise ImagePromptError(ERR_NOT_PLACED)
    job.prompt_ids = ids
    job.images = tuple(spans)
    job.image_inputs = tuple(placed)
