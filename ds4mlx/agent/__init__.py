"""`ds4mlx agent`: a local coding agent that owns the engine directly (no HTTP).

ds4's ds4-agent (antirez/ds4 ds4_agent.c) rebuilt: the model's own tool protocol
(the family's chat protocol renders the conversation and parses the calls), file
and shell tools confined to the project, approvals, context compaction, saved
sessions with disk KV checkpoints and a cooperative stop.

Modules, one job each:
  errors.py      ToolError (a refusal the model reads)
  paths.py       project-root confinement: paths walked from a descriptor of the root, no link followed by the kernel
  tools.py       the file tools (read, more, write, list, edit, search, view_image) and the tool table
  bashjobs.py    bash with background jobs (bash, bash_status, bash_stop)
  approval.py    yes/no approvals with a deny-by-default timeout
  prompts.py     the exact strings the model sees (system prompt, compaction request)
  compaction.py  when to compact and how the conversation is rebuilt
  sessions.py    sessions on disk (conversation JSON + KV checkpoint reasons, ids for /del and /strip)
  hooks.py       ds4's response hooks (--before/--after-response-hook: an event JSON on stdin)
  events.py      what the worker tells a front end
  worker.py      the agent loop: engine jobs, tool calls, stop, compaction, sessions
  render.py      tool cards, approval panels, the status line (rich)
  plain.py       the `-p` non-interactive front end
  tui.py         the interactive terminal UI (prompt_toolkit + rich)
  cli.py         `ds4mlx agent` arguments and start-up
"""
