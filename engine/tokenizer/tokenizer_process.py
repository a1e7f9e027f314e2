"""The tokenizer actor: requests in (text or chat), token ids out; tokens in, text deltas out.

It keeps the API process thin (no tokenization there) and the scheduler free of strings. Stop
strings are matched here; a match finishes the request and aborts it in the scheduler.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from deepinfer.engine.protocol import (
    Abort,
    FinishReason,
    GenerateRequest,
    LoRAUpdate,
    LoRAUpdated,
    OutputBatch,
    PositionLogprobs,
    RequestOutput,
    TokenDelta,
    TokenizedRequest,
    TokenizerInbound,
    TokenLogprob,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.runtime.ipc import pull, push
from deepinfer.engine.runtime.process_entry import ChildContext
from deepinfer.engine.tokenizer.detokenizer import IncrementalDetokenizer
from deepinfer.engine.tokenizer.prompt_logprobs import prompt_logprob_list
from deepinfer.engine.tokenizer.tokenizer import ChatTemplateError, Tokenizer, chat_dict

log = logging.getLogger("deepinfer.tokenizer")



class _Live(msgspec.Struct):
    detok: IncrementalDetokenizer
    logprobs: bool
    prompt_tokens: int
    completion_tokens: int = 0
    # The prompt, while its prompt logprobs (when asked) are still to go out.
    prompt_ids: list[int] | None = None


class TokenizerService:
    """Pure logic of the actor (no sockets), so tests can drive it directly."""

    def __init__(self, tokenizer: Tokenizer, context_len: int,
                 model_vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        # Ids the model can embed: the smaller of the tokenizer's and the model's vocabulary.
        self.vocab_limit = min(tokenizer.vocab_size, model_vocab_size or tokenizer.vocab_size)
        self.live: dict[str, _Live] = {}
        # First outputs of structured requests, held until the scheduler says their grammar
        # compiled: a refused grammar must reach the client as the first output (a 400).
        self.held: dict[str, RequestOutput] = {}

    def tokenize(self, req: GenerateRequest
                 ) -> tuple[TokenizedRequest | None, RequestOutput | None]:
        """Returns the scheduler's request (None when rejected) and the first client output
        (None: held until the request's grammar is ready)."""
        try:
            prompt_text = None
            if req.messages is not None:
                if not req.messages:
                    raise ValueError("messages must not be empty")
                prompt_text = self._within_reach(self.tokenizer.apply_chat_template(
                    [chat_dict(m) for m in req.messages], req.add_generation_prompt, req.tools,
                    req.template_kwargs, req.continue_final_message))
                # The template already holds every special token it wants.
                ids = self.tokenizer.encode(prompt_text, add_special_tokens=False)
            elif req.prompt_token_ids is not None:
                ids = unpack_ids(req.prompt_token_ids).tolist()
                bad = [i for i in ids if not 0 <= i < self.vocab_limit]
                if bad:
                    raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary")
                prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False)
            elif req.prompt is not None:
                prompt_text = self._within_reach(req.prompt)
                ids = self.tokenizer.encode(req.prompt)
            else:
                raise ValueError("a prompt, prompt token ids or messages are required")
            if not ids:
                raise ValueError("the prompt is empty")
            if req.count_only:
                return None, RequestOutput(req.request_id, finish_reason=FinishReason.STOP,
                                           prompt_tokens=len(ids))
            if len(ids) >= self.context_len:
                raise ValueError(
                    f"the prompt has {len(ids)} tokens; this server's context length (the "
                    f"model's, capped by its KV cache) is {self.context_len} tokens, which must "
                    "also leave room for the output"
                )
        except Exception as exc:  # bad input (template, ids, text) must not kill the process
            if not isinstance(exc, (ValueError, ChatTemplateError)):
                exc = ValueError(f"could not tokenize the request: {type(exc).__name__}: {exc}")
            return None, RequestOutput(
                req.request_id, finish_reason=FinishReason.ERROR, error=str(exc)
            )
        p = req.params
        self.live[req.request_id] = _Live(
            IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens, ids),
            logprobs=p.logprobs is not None,
            prompt_tokens=len(ids),
            prompt_ids=list(ids) if p.prompt_logprobs is not None else None,
        )
        first = RequestOutput(req.request_id, prompt_tokens=len(ids), prompt_text=prompt_text)
        tokenized = TokenizedRequest(req.request_id, pack_ids(ids), p)
        if p.grammar is not None:
            self.held[req.request_id] = first
            return tokenized, None
        return tokenized, first

    def _within_reach(self, text: str) -> str:
        """`text`, unless it is too long for the context whatever its tokens: then it is
        refused untokenized, since every stream's detokenization waits behind a tokenization
        (a 7 MiB prompt held them all for 34 s). Half the bound of n / max_token_chars
        tokens, for normalizers that compose characters."""
        floor = len(text) // (2 * self.tokenizer.max_token_chars)
        if floor >= self.context_len:
            raise ValueError(
                f"the prompt has at least {floor} tokens; this server's context length is "
                f"{self.context_len} tokens (it was not tokenized)")
        return text

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.live.pop(rid, None)
            self.held.pop(rid, None)

    def outputs(self, delta: TokenDelta) -> tuple[list[RequestOutput], bool]:
        """The client outputs for one delta (a held first output goes out before the delta's
        own, unless the delta refuses the request); the bool says the scheduler must abort it
        (stop string hit)."""
        held = self.held.pop(delta.request_id, None)
        if held is not None and delta.finish_reason != FinishReason.ERROR:
            if not len(delta.token_ids) and delta.finish_reason is None:
                return [held], False  # the grammar is ready: nothing else to say yet
            out, stop_hit = self.detokenize(delta)
            return [held] + ([out] if out is not None else []), stop_hit
        out, stop_hit = self.detokenize(delta)
        return ([out] if out is not None else []), stop_hit

    def detokenize(self, delta: TokenDelta) -> tuple[RequestOutput | None, bool]:
        """Text for one delta; the bool says the scheduler must abort it (stop string hit)."""
        live = self.live.get(delta.request_id)
        if live is None:  # aborted meanwhile
            return None, False
        ids = unpack_ids(delta.token_ids)
        n_before = live.completion_tokens
        # The token that stopped the output (EOS, a stop token id: the scheduler's STOP) is
        # counted but not written: kept special tokens would show it (`<|im_end|>`), as vLLM.
        stop_token = delta.finish_reason == FinishReason.STOP and len(ids) > 0
        text_ids = ids[:-1] if stop_token else ids
        used = live.detok.add(text_ids)
        if used == len(text_ids):
            used = len(ids)
        ids = ids[:used]  # tokens after a stop string are dropped, their logprobs too
        live.completion_tokens += len(ids)
        finish = delta.finish_reason
        stop_hit = live.detok.stopped and finish is None
        kv_transfer = delta.kv_transfer
        if kv_transfer is not None and live.detok.stopped:
            # A stop string ended it for good: no decode server continues it, and the scheduler
            # frees the KV it held for one.
            kv_transfer, stop_hit = None, True
        if live.detok.stopped:
            finish = FinishReason.STOP
        text = live.detok.take(final=finish is not None)
        logprobs = []
        if live.logprobs and delta.logprobs:
            tt = self.tokenizer.token_text
            for lp in delta.logprobs[:used]:
                logprobs.append(PositionLogprobs(
                    TokenLogprob(lp.token_id, tt(lp.token_id), lp.logprob),
                    [TokenLogprob(i, tt(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)],
                ))
        out = RequestOutput(
            delta.request_id,
            text=text,
            token_ids=ids.tobytes(),
            logprobs=logprobs,
            finish_reason=finish,
            prompt_tokens=live.prompt_tokens,
            completion_tokens=n_before + len(ids),
            cached_tokens=delta.cached_tokens,
            error=delta.error,
            replayed_tokens=delta.replayed_tokens,
            kv_transfer=kv_transfer,
            stop_reason=live.detok.stop_string,
        )
        if live.prompt_ids is not None and (len(ids) or finish is not None):
            # The scheduler sends them all on the first delta with a token or a finish.
            out.prompt_logprobs = prompt_logprob_list(live.prompt_ids, delta.prompt_logprobs,
                                                      self.tokenizer.token_text)
            live.prompt_ids = None
        if finish is not None:
            del self.live[delta.request_id]
        return out, stop_hit


def main(ctx: ChildContext) -> None:
    cfg = ctx.config
    service = TokenizerService(Tokenizer(cfg.resolved_model_dir()), cfg.context_len(),
                               cfg.model_config().vocab_size)
    inbound = pull(ctx.zmq, ctx.endpoints.tokenizer_in)
    to_client = push(ctx.zmq, ctx.endpoints.client_in)
    to_scheduler = push(ctx.zmq, ctx.endpoints.scheduler_in)
    decode = msgspec.msgpack.Decoder(TokenizerInbound).decode
    encode = msgspec.msgpack.Encoder().encode
    detokenize_seconds = 0.0
    ctx.ready(context_len=str(cfg.context_len()), vocab_size=str(service.tokenizer.vocab_size))
    while True:
        # Block until something arrives, then drain everything queued and answer once.
        msgs = [decode(inbound.recv())]
        while inbound.poll(0):
            msgs.append(decode(inbound.recv(zmq.NOBLOCK)))
        outputs: list[RequestOutput] = []
        lora_updates: list[LoRAUpdated] = []
        stats = None
        for msg in msgs:
            if isinstance(msg, GenerateRequest):
                tokenized, first = service.tokenize(msg)
                if first is not None:
                    outputs.append(first)
                if tokenized is not None:
                    to_scheduler.send(encode(tokenized))
            elif isinstance(msg, Abort):
                service.abort(msg.request_ids)
                to_scheduler.send(encode(msg))
            elif isinstance(msg, LoRAUpdate):  # the scheduler's to check and answer
                to_scheduler.send(encode(msg))
            else:
                t0 = time.perf_counter()
                stats = msg.stats or stats
                lora_updates.extend(msg.lora_updates)
                stopped = []
                for delta in msg.deltas:
                    outs, stop_hit = service.outputs(delta)
                    outputs.extend(outs)
                    if stop_hit:
                        stopped.append(delta.request_id)
                if stopped:  # a normal finish for the scheduler: its KV is worth caching
                    to_scheduler.send(encode(Abort(stopped, FinishReason.STOP)))
                detokenize_seconds += time.perf_counter() - t0
        if stats is not None:
            stats.detokenize_seconds = detokenize_seconds
        if outputs or stats is not None or lora_updates:
            to_client.send(encode(OutputBatch(outputs, stats, lora_updates)))
