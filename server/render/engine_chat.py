"""vLLM's own chat render, run in the front: the ids the engine gets are the engine's render.

The front builds, from the very argument list the engine is started with, what vLLM's API server
builds to serve a chat request: vLLM's argument parser, model and tokenizer configuration, its
renderer and its chat route's preprocessing (``OnlineRenderer.render_chat``: the request model's
validation and normalization of messages, tool dumping, tool-choice checks, chat-template
parameters, the template itself with vLLM's developer-role handling, tokenization parameters and
length checks). It is built the way vLLM builds its GPU-less render server
(``vllm.entrypoints.launchers.render``). One step is replaced: the rendered text's tokenization is
incremental per conversation (``compaction.token_cache``), and equal to the whole text's tokenization.

Where vLLM renders outside this path, the front does not render (``unrendered`` says why, the
request goes to vLLM as messages): harmony (gpt-oss), renderer modes other than the HF one
(mistral, deepseek_v32, deepseek_v4, kimi_k3, cohere, ...) and a chat template that reads the
clock (vLLM renders it at the engine's moment). A request vLLM's code refuses or cannot tokenize
here (an invalid request, an output limit past the window) also goes as messages: the engine then
answers it in its own words.

``chat_text`` gives the context step's counting the same normalization and template (no
tokenization, no request-specific template parameters).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Hashable, Sequence
from typing import Any

from agentkv.compaction.token_cache import Splits, TokenCache

log = logging.getLogger(__name__)

# the conversation a render belongs to (its token-cache slot), for the tokenization step vLLM calls
SLOT: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("agentkv_render_slot", default=None)
CLOCK = ("strftime_now", "now(")


class NotRendered(Exception):
    """The front does not render this request; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


class ConversationRefused(ValueError):
    """vLLM's request model or chat template refuses the conversation (a 400 naming the
    request's conversation field, as the engine would answer)."""


def _request_copy(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its own message dicts: vLLM's request model renames keys in place."""
    return {**body, "messages": [dict(m) if isinstance(m, dict) else m for m in body.get("messages") or []]}


def _incremental_renderer_class():
    from vllm.renderers.hf import HfRenderer

    class IncrementalHfRenderer(HfRenderer):
        """vLLM's HF renderer, its tokenization reusing the slot's previous prompt (``SLOT``)."""

        def __init__(self, config, tokenizer):
            super().__init__(config, tokenizer)
            fast = bool(getattr(self.tokenizer, "is_fast", False))
            self.tokens = TokenCache(Splits(self.tokenizer)) if fast else None
            # vLLM binds its async tokenization at construction to an executor call that does not
            # carry context variables: this one does (the slot)
            self._tokenize_prompt_async = self._tokenize_in_context

        async def _tokenize_in_context(self, prompt, params):
            run = contextvars.copy_context().run
            return await asyncio.get_running_loop().run_in_executor(self._executor, run, self._tokenize_prompt,
                                                                    prompt, params)

        def _tokenize_prompt(self, prompt, params):
            slot = SLOT.get()
            kwargs = params.get_encode_kwargs()
            tokenizer = self.tokenizer   # not None where self.tokens is set (a fast tokenizer)
            if (slot is None or self.tokens is None or tokenizer is None or self._wants_offsets(prompt, params)
                    or params.truncate_prompt_tokens is not None or kwargs.get("add_special_tokens")):
                return super()._tokenize_prompt(prompt, params)

            def encode(text: str):
                enc = tokenizer(text, **kwargs, return_offsets_mapping=True)
                return enc["input_ids"], enc["offset_mapping"]
            return self._build_tokens_prompt(self.tokens.tokenize(slot, prompt["prompt"], encode), prompt)

    return IncrementalHfRenderer


class EngineChat:
    """vLLM's chat preprocessing for the engine started with ``argv`` (the arguments after
    ``python -m vllm.entrypoints.openai.api_server``). Construction imports vLLM (seconds)."""

    def __init__(self, argv: Sequence[str], model_name: str):
        from vllm import AsyncEngineArgs
        from vllm.config import VllmConfig
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, resolve_default_chat_template_kwargs
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.hf import HfRenderer
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.renderers.registry import RENDERER_REGISTRY
        from vllm.tokenizers.registry import cached_tokenizer_from_config, tokenizer_args_from_config
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.model_name = model_name
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(argv))
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None   # as vLLM's render server: no kernels here
        config = VllmConfig(model_config=model_config, logging_config=engine_args.create_logging_config(),
                            structured_outputs_config=engine_args.create_structured_outputs_config())
        tokenizer = cached_tokenizer_from_config(model_config)
        self.base_tokenizer = tokenizer   # the renderer works on a copy of its own (with a thread pool)
        mode, *_ = tokenizer_args_from_config(model_config)
        cls = RENDERER_REGISTRY.load_renderer_cls(mode)
        self.hf = cls is HfRenderer
        self.renderer = (_incremental_renderer_class() if self.hf else cls)(config, tokenizer)
        self.online = OnlineRenderer(
            model_config=model_config, renderer=self.renderer, request_logger=None,
            chat_template=load_chat_template(args.chat_template),
            chat_template_content_format=args.chat_template_content_format,
            trust_request_chat_template=args.trust_request_chat_template,
            trust_request_mm_kwargs=args.trust_request_mm_kwargs,
            enable_auto_tools=args.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            tool_parser=args.tool_call_parser, tool_strict_level=args.tool_strict_level,
            reasoning_parser=args.reasoning_parser or config.structured_outputs_config.reasoning_parser,
            default_chat_template_kwargs=resolve_default_chat_template_kwargs(args))
        template = self.online.chat_template or getattr(tokenizer, "chat_template", None)
        template = "\n".join(template.values()) if isinstance(template, dict) else (template or "")
        self.template = template
        self.unrendered: str | None = None
        if self.online.use_harmony:
            self.unrendered = "gpt-oss prompts are rendered by vLLM's harmony encoder"
        elif not self.hf:
            self.unrendered = f"vLLM renders this model with its {mode!r} renderer"
        elif any(c in template for c in CLOCK):
            self.unrendered = "the chat template reads the clock (vLLM renders it at each request)"

    @property
    def tokenizer(self):
        return self.renderer.tokenizer

    @property
    def token_cache(self) -> TokenCache | None:
        return getattr(self.renderer, "tokens", None)

    def _request(self, body: dict[str, Any]):
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError

        try:
            return ChatCompletionRequest.model_validate(_request_copy(body))
        except ValidationError as exc:
            raise ConversationRefused(f"the engine's request model refuses it: {exc.errors()[0].get('msg')}") from None
        except VLLMValidationError as exc:   # some of its validators raise this, not through pydantic
            raise ConversationRefused(f"the engine's request model refuses it: {exc}") from None

    def chat_text(self, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        """The prompt text vLLM renders for ``messages`` and ``tools`` with the server's template
        parameters (for counting: no tokenization)."""
        from pydantic import ValidationError
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers import merge_kwargs

        body: dict[str, Any] = {"model": self.model_name, "messages": messages,
                                "add_generation_prompt": add_generation_prompt}
        if tools:
            body["tools"] = tools
        request = self._request(body)
        online = self.online
        tool_dicts = None if request.tools is None else [t.model_dump() for t in request.tools]
        params = request.build_chat_params(online.chat_template, online.chat_template_content_format).with_defaults(
            merge_kwargs(online.default_chat_template_kwargs, dict(tools=tool_dicts, tokenize=False)))
        try:
            _, prompt = self.renderer.render_messages(request.messages, params)
        except VLLMValidationError as exc:
            raise ConversationRefused(f"the model's chat template cannot render this conversation: {exc}") from None
        except ValidationError as exc:   # vLLM validates content parts as it reads them
            raise ConversationRefused(f"the engine's request model refuses it: {exc.errors()[0].get('msg')}") from None
        return prompt["prompt"]  # type: ignore[typeddict-item]  # vLLM says DictPrompt; tokenize=False: a TextPrompt

    async def prompt_ids(self, body: dict[str, Any], slot: Hashable) -> list[int]:
        """The ids vLLM's chat route gives ``body`` (a chat completion request), tokenized
        incrementally in ``slot``; ``NotRendered`` where the front does not render it."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if self.unrendered:
            raise NotRendered("renderer", self.unrendered)
        try:
            request = await asyncio.to_thread(self._request, body)
        except ConversationRefused as exc:
            raise NotRendered("refused", str(exc)) from None
        token = SLOT.set(slot)
        try:
            result = await self.online.render_chat(request)
        except Exception as exc:  # noqa: BLE001 - vLLM's own checks: the engine answers it in its words
            raise NotRendered("refused", f"{exc.__class__.__name__}: {exc}") from None
        finally:
            SLOT.reset(token)
        if isinstance(result, ErrorResponse):
            raise NotRendered("refused", result.error.message)
        _, inputs = result
        first = inputs[0] if len(inputs) == 1 else None
        if first is None or "type" not in first or first["type"] != "token":
            raise NotRendered("non_text_content")
        return first["prompt_token_ids"]


def counting_renderer(chat: EngineChat):
    """A ``compaction.prompt.PromptRenderer`` that counts with ``chat``'s render: vLLM's message
    normalization and template, the engine's tokenizer."""
    from agentkv.compaction.prompt import PromptRenderer
    from agentkv.compaction.prompt_segments import check_template

    return PromptRenderer(chat.base_tokenizer, render_text=chat.chat_text, check=check_template(chat.chat_text,
                                                                                               chat.template))


def for_model(path: str, *engine_args: str, model_name: str = "model") -> EngineChat:
    """vLLM's chat render of the model at ``path`` as an engine started with ``engine_args`` would
    render it (tests, benchmarks, library use)."""
    return EngineChat(["--model", str(path), *engine_args], model_name)

