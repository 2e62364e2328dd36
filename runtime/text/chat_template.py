"""Render a model's chat template (Jinja) the way transformers' apply_chat_template does.

Same environment as transformers: sandboxed and immutable (a template is untrusted input from the
model files), trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that does not HTML-escape, and a `{% generation %}` block that just renders its body.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vtool import VtoolError


class ChatTemplateError(VtoolError):
    """The template is missing or broken, or it rejected the messages (via raise_exception)."""


def select_chat_template(value: Any, source: str = "tokenizer_config.json", name: str = "default") -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (pick `name`)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if name in named and isinstance(named[name], str):
            return named[name]
        raise ChatTemplateError(f"{source}: chat_template lists templates {sorted(map(str, named))} "
                                f"but none named {name!r}")
    raise ChatTemplateError(f"{source}: chat_template is a {type(value).__name__}; expected a string "
                            "or a list of {name, template}")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template refused the messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '); transformers' does not, and templates expect that.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from e


def render_chat_template(template: str | None, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = False, tools: Sequence[Any] | None = None,
                         documents: Sequence[Any] | None = None, **kwargs: Any) -> str:
    """The prompt text. kwargs reach the template as variables (bos_token, eos_token, enable_thinking...)."""
    if template is None:
        raise ChatTemplateError("the model has no chat template (none in tokenizer_config.json, "
                                "chat_template.jinja or the GGUF's tokenizer.chat_template), so it cannot chat")
    compiled = _compile(template)
    try:
        return compiled.render(messages=[dict(m) for m in messages], tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:  # includes sandbox violations
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        # e.g. a template that adds strings meeting an assistant turn whose content is null (a
        # tool call) it was not written for: the request's messages, not the server, are at fault
        raise ChatTemplateError(f"the model's chat template cannot render these messages: "
                                f"{type(e).__name__}: {e}") from e
