"""One slot's runner: what runs a request on a slot's session (engine/request.py),
and the `SlotContext` the cache hooks and the image reuse (vision/reuse.py) get.

The scheduler owns the slots and hands each request's turn to its slot's runner;
everything shared (model, tokenizer, protocol, limits, memory checkpoints,
counters) is the engine's, and the runner reads it there.  No state of "the
current slot" exists anywhere: a runner is bound to its slot for life.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .bindings import KEEP_BINDING, KEEP_THINKING, Binding
from .checkpoints import EVICTED, TAIL
from .slots import Slot

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger("ds4mlx.engine")


class SlotRunner:
    def __init__(self, engine: Engine, slot: Slot):
        self.engine = engine
        self.slot = slot

    # ------------------------------------------------ the slot's state
    @property
    def session(self):
        return self.slot.session

    @session.setter
    def session(self, s) -> None:
        self.slot.session = s

    @property
    def cache(self):
        """This slot's disk-cache hooks (engine/hooks.py)."""
        return self.slot.cache

    # ------------------------------------------------ the engine's, for hooks and the image reuse
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def tool_memory(self):
        return self.engine.tool_memory

    @property
    def model(self):
        return self.engine.model

    @property
    def ctx(self) -> int:
        return self.engine.ctx

    @property
    def checkpoints(self):
        return self.engine.checkpoints

    @property
    def vision(self):
        return self.engine.vision

    # the image reuse state is the engine's (one slot with --vision: serve/cli.py)
    @property
    def live_images(self):
        return self.engine.live_images

    @live_images.setter
    def live_images(self, v) -> None:
        self.engine.live_images = v

    @property
    def vision_checkpoint(self):
        return self.engine.vision_checkpoint

    @vision_checkpoint.setter
    def vision_checkpoint(self, v) -> None:
        self.engine.vision_checkpoint = v

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    # ------------------------------------------------ session lifetime
    def reset_session(self) -> None:
        """Empty the slot's session (worker thread only: the disk cache calls it when a
        restore fails half-way)."""
        reset = getattr(self.session, "reset", None)
        if reset is not None:
            reset()
        else:
            self.session = self.engine.model.new_session(self.engine.ctx)

    def new_session(self) -> None:
        """A fresh session of the engine's ctx, no bindings (between jobs)."""
        self.session = self.engine.model.new_session(self.engine.ctx)
        self.clear_bindings(keep=None)

    def invalidate(self) -> None:
        """Forget the live state (stop-sequence hit, failures)."""
        self.reset_session()
        self.clear_bindings(keep=None)

    # ------------------------------------------------ bindings (engine/bindings.py)
    def clear_bindings(self, keep: str | None) -> None:
        with self.engine.bind_lock:
            if keep != KEEP_BINDING:
                self.slot.binding = None
            if keep != KEEP_THINKING:
                self.slot.thinking = None

    def keep_bindings(self, front: Binding | None, thinking: Binding | None) -> None:
        with self.engine.bind_lock:
            self.slot.binding, self.slot.thinking = front, thinking

    def bindings(self) -> tuple[Binding | None, Binding | None]:
        with self.engine.bind_lock:
            return self.slot.binding, self.slot.thinking

    def live_visible_text(self) -> str | None:
        """The visible transcript a front-end / thinking binding remembers for the
        live session (the front end's wins), or None: the key of visible-keyed saves."""
        key = self.live_visible_key()
        return key[1] if key else None

    def live_visible_key(self) -> tuple[str, str] | None:
        """(kind, visible transcript) of `live_visible_text`; kind is "<key>-visible"
        (the front end's binding key) or "thinking-visible"."""
        front, think = self.bindings()
        pos = len(self.session)
        for kind, b in ((f"{front.key}-visible" if front else "", front), ("thinking-visible", think)):
            if b is not None and b.visible_text and b.live_tokens == pos:
                return kind, b.visible_text
        return None

    def live_text(self) -> str:
        """decode(live tokens), memoized per session state: the router probes idle slots again and again."""
        sl, s = self.slot, self.session
        key = (id(s), len(s), s.tokens[-1] if len(s) else None)
        if sl.text_key != key:
            sl.text_key, sl.text = key, self.engine.tokenizer.decode(s.tokens)
        return sl.text

    # ------------------------------------------------ in-memory checkpoints (engine/checkpoints.py)
    def restore_checkpoint(self, cp) -> bool:
        """Replace the live session by a checkpoint (False if it does not restore)."""
        try:
            self.session.restore(cp.blob)
        except ValueError:
            log.exception("memory checkpoint restore failed")
            self.reset_session()
            return False
        self.engine.checkpoints.restored += 1
        return True

    def checkpoint(self, effective: list[int], cached: int) -> None:
        """Keep the session at the end of this prompt for a later request that shares it."""
        if self.live_images is not None:  # token-keyed checkpoints cannot tell images apart
            return
        cps = self.engine.checkpoints
        if cps.wants(len(effective), len(effective) - cached):
            try:
                cps.save(effective, self.session)
            except Exception:  # a session without snapshots: no checkpoints, nothing lost
                log.exception("memory checkpoint failed")

    def tail_point(self, total: int, cached: int) -> int:
        """Where this prompt's prefill stops for its tail checkpoint (0 = none; not with images)."""
        return self.engine.checkpoints.tail_point(total, cached) if self.live_images is None else 0

    def checkpoint_tail(self, tokens: list[int]) -> None:
        """The session holds exactly `tokens`, a prompt's tail point: keep it."""
        self._save(tokens, TAIL)

    def checkpoint_evicted(self) -> None:
        """The live session is about to be replaced by another request's: keep it for its
        own client's next turn (while the checkpoint budget lasts)."""
        s = self.session
        if self.live_images is None and self.engine.checkpoints.wants(len(s), 1):
            self._save(s.tokens, EVICTED)

    def _save(self, tokens, kind: str) -> None:
        try:
            self.engine.checkpoints.save(tokens, self.session, kind=kind)
        except Exception:  # a session without snapshots: no checkpoints, nothing lost
            log.exception("memory checkpoint failed")

    def checkpoint_frontier(self) -> None:
        """While generating: keep the session at an aligned frontier, for a new turn or
        retry whose common prefix ends inside this answer."""
        s, cps = self.session, self.engine.checkpoints
        if self.live_images is None and cps.due(len(s)):
            try:
                cps.save(s.tokens, s, frontier=True)
            except Exception:
                log.exception("memory checkpoint failed")
