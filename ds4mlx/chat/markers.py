"""Every exact protocol string of the chat layer, in one place.

Prompt special strings and the Think-Max prefix: docs/chat-template.md §1, §3.
Tools block: docs/chat-template.md §5.  DSML spellings: docs/dsml.md §1.  These are
protocol data: they must match ds4 byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- special tokens (docs/chat-template.md §1) -----------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
SPECIAL_STRINGS = (BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML)

# --- model ids /v1/models reports, and the aliases that set thinking off / on (docs/http-api.md §1.2)
DEEPSEEK_V4_MODEL_ID = "deepseek-v4-flash"
DEEPSEEK_V4_CHAT_ALIAS = "deepseek-chat"
DEEPSEEK_V4_REASONER_ALIAS = "deepseek-reasoner"

# --- tool results (docs/chat-template.md §7) --------------------------------------
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# --- legacy /v1/completions system line (docs/chat-template.md §4.3) --------------
COMPLETION_SYSTEM = "You are a helpful assistant"

# --- Think Max (docs/chat-template.md §3) ------------------------------------------
THINK_MAX_MIN_CONTEXT = 393216
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no "
    "assumption is left unchecked.\n\n"
)

# --- tools block (docs/chat-template.md §5) ----------------------------------------
# The example block and the closing rules ds4's tools text and the official encoder's share.
_DSML_EXAMPLE = (
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
)
_TOOLS_RULES = (
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format "
    'and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_BLOCK_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    + _DSML_EXAMPLE
    + (
        'String parameters should be specified as raw text and set `string="true"`. '
        "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string "
        "characters with XML or HTML entity escapes. "
        "Only if a string value itself contains the exact closing parameter tag "
        "`</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. "
    )
    + _TOOLS_RULES
)
TOOLS_BLOCK_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
    "invoke tool calls. Use the exact parameter names from the schemas."
)

# --- DeepSeek's own V4 encoder, `--chat-template official` (docs/chat-template.md §11) --
# Chat template names every command accepts (the default is ds4's renderer).
CHAT_TEMPLATE_DS4 = "ds4"
CHAT_TEMPLATE_OFFICIAL = "official"
CHAT_TEMPLATES = (CHAT_TEMPLATE_DS4, CHAT_TEMPLATE_OFFICIAL)
# The encoder's tools text (`TOOLS_TEMPLATE` of encoding_dsv4.py): "the user's question", a
# shorter string-parameter rule, no "Use the exact parameter names" sentence and a final LF.
OFFICIAL_TOOLS_BLOCK_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    + _DSML_EXAMPLE
    + 'String parameters should be specified as is and set `string="true"`. '
    + _TOOLS_RULES
)
OFFICIAL_TOOLS_BLOCK_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
# What the encoder puts between a system text and its tools block, and between the
# blocks (text, tool results) of one merged user turn.
OFFICIAL_SECTION_SEPARATOR = "\n\n"
# The parameter a tool call whose arguments are not a JSON object is rendered under.
OFFICIAL_RAW_ARGUMENTS_KEY = "arguments"


# --- DSML spellings (docs/dsml.md §1) ----------------------------------------------
@dataclass(frozen=True)
class DsmlSyntax:
    """One spelling of the DSML grammar; a block uses one spelling throughout."""

    name: str
    open: str  # block open
    close: str  # block close
    invoke: str  # invoke open prefix (attributes follow, up to ">")
    invoke_close: str
    param: str  # parameter open prefix
    param_close: str


DSML_FULL = DsmlSyntax(
    "full",
    f"<{DSML}tool_calls>",
    f"</{DSML}tool_calls>",
    f"<{DSML}invoke",
    f"</{DSML}invoke>",
    f"<{DSML}parameter",
    f"</{DSML}parameter>",
)
DSML_SHORT = DsmlSyntax(
    "short",
    "<DSML｜tool_calls>",
    "</DSML｜tool_calls>",
    "<DSML｜invoke",
    "</DSML｜invoke>",
    "<DSML｜parameter",
    "</DSML｜parameter>",
)
DSML_PLAIN = DsmlSyntax("plain", "<tool_calls>", "</tool_calls>", "<invoke", "</invoke>", "<parameter", "</parameter>")
# The final parser's search priority (docs/dsml.md §2): full, then short, then plain.
DSML_SYNTAXES = (DSML_FULL, DSML_SHORT, DSML_PLAIN)
# DeepSeek V4.1's spelling: a space after the DSML token and `calls` for the block
# (`<｜DSML｜ calls>`, `<｜DSML｜ invoke name=..>`, `</｜DSML｜ parameter>`).  V4.1
# parsers search it first, then the V4 spellings.
DSML_SPACED = DsmlSyntax(
    "spaced",
    f"<{DSML} calls>",
    f"</{DSML} calls>",
    f"<{DSML} invoke",
    f"</{DSML} invoke>",
    f"<{DSML} parameter",
    f"</{DSML} parameter>",
)
DSML_SYNTAXES_V41 = (DSML_SPACED,) + DSML_SYNTAXES
DSML_BLOCK_SEPARATOR = "\n\n"

# Attribute / string-value entities decoded by the parser (docs/dsml.md §1).
DSML_ENTITIES = (("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"))
# The one escape the renderer writes inside parameter text / JSON literals (docs/chat-template.md §6).
PARAM_CLOSE_TEXT_ESCAPE = "&lt;"
PARAM_CLOSE_JSON_ESCAPE = "\\u003c"

# --- tool call ids (docs/dsml.md §8) -------------------------------------------------
OPENAI_TOOL_ID_PREFIX = "call_"
ANTHROPIC_TOOL_ID_PREFIX = "toolu_"

# --- request errors raised by the API parsers (docs/http-api.md §1.6 + our issue) ----
ERR_INVALID_JSON = "invalid JSON request"
ERR_MISSING_MESSAGES = "missing messages"
ERR_MISSING_INPUT = "missing input"
ERR_MISSING_PROMPT = "missing prompt"
ERR_EMPTY_MESSAGES = "messages must not be empty"
ERR_UNKNOWN_ROLE = "unknown role: {role}"
ERR_TOOL_CHOICE = "tool_choice={value} not supported"
ERR_FORCED_TOOL_CHOICE = "forced tool_choice not supported"
ERR_DURABLE_STATE = "{field} is not supported; replay full input instead"
ERR_RESPONSES_UNKNOWN_CALL = (
    "Responses continuation state is not available for call_id {id}; retry by replaying the full input history"
)
ERR_ANTHROPIC_UNKNOWN_CALL = (
    "Anthropic continuation state is not available for tool_use_id {id}; retry by replaying the full messages history"
)

# the anthropic-beta value of message threads (refused: serve/anthropic.py refuse_threads)
ANTHROPIC_THREADS_BETA = "message-threads-2026-08-12"

# --- parse diagnostics (ParsedOutput.error; ds4 logs these) ------------------------
PARSE_INVALID_TOOL_CALL = "invalid tool call"
PARSE_UNTERMINATED_TOOL_CALL = "unterminated tool call"
# a call the stream had announced broke off: it is kept with the arguments sent so far
PARSE_CUT_TOOL_CALL = "tool call cut short"
# the token limit ended the output inside a block: no call of it is returned (docs/dsml.md §3.1)
PARSE_LIMIT_TOOL_CALL = "tool call cut by the token limit"
