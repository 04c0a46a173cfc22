"""Multi-turn chat over one model, reusing the KV cache across turns.

Each ``send`` renders the whole conversation with the model's chat template and tokenizes it;
the longest common prefix with the tokens already in the KV cache is kept (``model.truncate``)
and only the rest is prefilled. The cache holds the tokens actually generated, so when the
template re-renders the reply differently (another tokenization, an end token the model did or
did not emit) the prefix comparison finds the divergence and re-prefills from there.
"""

from __future__ import annotations

from collections.abc import Iterator

from poly.errors import GenerationError, ModelBusyError, StateFileError
from poly.text.gendefaults import resolve
from poly.text.generation import DoneEvent, TokenStream, model_lock, stream_tokens
from poly.text.sampling import GenOptions, Sampler
from poly.text.speculative import Speculation


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """A conversation with ``model``; the session owns the model's KV cache while it is used."""

    def __init__(
        self,
        model,
        *,
        system: str | None = None,
        options: GenOptions | None = None,
        label: str = "argument",
        speculation: Speculation | None = None,
        **overrides,
    ):
        """Options: ``overrides`` (e.g. ``temperature=0.2``) > ``options`` or the model file's
        settings > the fallback (`poly.text.gendefaults.resolve`; ``label`` names the explicit ones
        in `resolved.origins`). ``speculation``: every reply's (poly.text.speculative)."""
        self.model = model
        self.speculation = speculation
        self.resolved = resolve(model, options, overrides, label=label)
        self.options = self.resolved.options
        self._system = system
        self._turns: list[tuple[str, str]] = []  # (user, assistant) pairs
        self._cache_ids: list[int] = []  # token ids in the model's KV cache, in order
        self._sampler: Sampler | None = None
        self.last_prefill_tokens = 0
        self.last_done: DoneEvent | None = None
        self.turns = 0

    # --- conversation state ---------------------------------------------------------------------

    @property
    def system(self) -> str | None:
        return self._system

    @property
    def history(self) -> list[dict[str, str]]:
        """The messages as the chat template sees them (system first, if any)."""
        msgs = [] if self._system is None else [{"role": "system", "content": self._system}]
        for user, assistant in self._turns:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return msgs

    @property
    def stats(self) -> dict:
        d = self.last_done
        return {
            "turns": self.turns,  # completed in this session's life, across resets and drops
            "turns_in_history": len(self._turns),  # what the next prompt still carries
            "tokens_in_cache": int(self.model.position),
            "last_prefill_tokens": self.last_prefill_tokens,
            "last_prefill_tok_s": d.prefill_tok_s if d else 0.0,
            "last_decode_tok_s": d.decode_tok_s if d else 0.0,
            "last_stop_reason": d.stop_reason if d else None,
        }

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and empty the KV cache."""
        self._turns.clear()
        self._cache_ids = []
        self.model.reset()

    def set_system(self, text: str | None, *, keep_history: bool = False) -> None:
        """Set the system message; the conversation restarts unless ``keep_history``."""
        self._system = text or None
        if not keep_history:
            self.reset()

    def set_option(self, name: str, value) -> None:
        """Change one generation option (validated); the random stream continues unless ``seed``."""
        self.resolved = self.resolved.replace("/set", **{name: value})
        self.options = self.resolved.options
        old, self._sampler = self._sampler, None
        if old is not None and name != "seed":
            self._sampler = self._new_sampler()
            self._sampler.rng = old.rng

    def drop_oldest_turns(self, n: int = 1) -> int:
        """Remove the ``n`` oldest user/assistant turns to make room; returns how many went.

        The cache is not touched here: the next ``send`` finds the divergence (right after the
        system message) and re-prefills from it.
        """
        if not self._turns:
            raise GenerationError("no earlier turns to drop: the message alone exceeds the context")
        n = max(1, min(int(n), len(self._turns)))
        del self._turns[:n]
        return n

    # --- saved state -----------------------------------------------------------------------------

    def save(self, path) -> int:
        """Write the conversation (system message, turns, the sampler's random state) and the KV
        cache it built to `path` (Transformer.save_state) -> bytes written."""
        chat = {"system": self._system, "turns": [list(t) for t in self._turns]}
        if self._sampler is not None:
            chat["rng"] = self._sampler.rng.bit_generator.state
        ids = self._cached()
        with _held(self.model):
            tokens = ids if len(ids) == self.model.position else None
            return self.model.save_state(path, tokens=tokens, meta={"chat": chat})

    def load(self, path) -> int:
        """Restore a conversation and its KV cache saved by `save` (the options in use stay) ->
        the turns restored. The next `send` prefills only its own message."""
        with _held(self.model):
            saved = self.model.load_state(path)
        chat = saved.meta.get("chat")
        if not _is_chat(chat):
            self._cache_ids = []  # the cache is the file's now: the next send re-prefills
            raise StateFileError("the state file holds no chat conversation", path=str(path))
        self._system = chat["system"]
        self._turns = [(u, a) for u, a in chat["turns"]]
        self._cache_ids = list(saved.tokens or ())
        self.last_done = None
        if isinstance(chat.get("rng"), dict):
            self._sampler = self._sampler or self._new_sampler()
            try:
                self._sampler.rng.bit_generator.state = chat["rng"]
            except (TypeError, ValueError, KeyError):
                raise StateFileError("the state file's random state is damaged") from None
        return len(self._turns)

    # --- a turn ---------------------------------------------------------------------------------

    def _new_sampler(self) -> Sampler:
        eos = tuple(getattr(self.model, "eos_token_ids", ()))
        tok = getattr(self.model, "tokenizer", None)
        return Sampler(self.options, self.model.config.vocab_size, eos, tok)

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.model.chat_template.render(messages, add_generation_prompt=True)
        return list(self.model.tokenizer.encode(text, add_special_tokens=False))

    def _cached(self) -> list[int]:
        # someone else moved the model (another session, a plain stream): trust nothing
        if len(self._cache_ids) != self.model.position:
            return []
        return self._cache_ids

    def send(self, user_text: str, *, stop=None) -> TokenStream:
        """Stream the reply to ``user_text``: ``TokenEvent``s, then a ``DoneEvent``.

        Raises ``ContextOverflowError`` before anything runs if the conversation plus
        ``max_tokens`` does not fit (see ``drop_oldest_turns``), ``ModelBusyError`` if the model
        is streaming elsewhere.
        """
        ids = self._encode(self.history + [{"role": "user", "content": user_text}])
        # keep >= 1 token to prefill: the last position's logits are needed for the first sample
        prefix = min(common_prefix(ids, self._cached()), len(ids) - 1)
        if self._sampler is None:
            self._sampler = self._new_sampler()
        stream = stream_tokens(
            self.model,
            ids[prefix:],
            self.options,
            stop=stop,
            start_fresh=prefix <= 0,
            history=ids[:prefix],
            sampler=self._sampler,
            speculation=self.speculation,
        )
        gen = self._turn(stream, user_text, ids)
        return TokenStream(gen, stream.close, stream.state)

    def _turn(self, stream: TokenStream, user_text: str, ids: list[int]) -> Iterator:
        failed = False
        try:
            for event in stream:
                if isinstance(event, DoneEvent):
                    self.last_done = event
                yield event
        except Exception:  # any error (not only PolyError) fails the turn: it is not recorded
            failed = True
            raise
        finally:
            stream.close()
            self._after_turn(stream, user_text, ids, failed)

    def _after_turn(self, stream: TokenStream, user_text: str, ids: list[int], failed) -> None:
        state = stream.state
        seq = ids + state.generated
        pos = int(self.model.position)
        # the cache holds the prompt and every generated token but the last (never fed back)
        self._cache_ids = seq[:pos] if pos <= len(seq) else []
        if not state.prefilled:
            return
        self.last_prefill_tokens = state.prefill_tokens
        if failed:
            return
        self._turns.append((user_text, state.text))
        self.turns += 1


def _is_chat(chat) -> bool:
    """Whether a saved state's meta is a conversation: a system message (or None) and a list of
    (user, assistant) text pairs."""
    if not isinstance(chat, dict) or not isinstance(chat.get("system"), (str, type(None))):
        return False
    turns = chat.get("turns")
    return isinstance(turns, list) and all(
        isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in turns
    )


class _held:
    """The model's lock for a save or load, not waited for: ModelBusyError while a reply runs."""

    def __init__(self, model):
        self.lock = model_lock(model)

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            raise ModelBusyError("the model is in use by a generation; save or load after it")

    def __exit__(self, *exc):
        self.lock.release()
