"""mkdocs hook: pages rendered from the code at build time, so that they cannot drift: the configuration reference
(grpo_accel.config.reference, the same text ``grpo-accel train --help`` prints) and the TRL field lists
(grpo_accel.config.reference.trl_markdown)."""
MARKER = "<!-- generated: grpo_accel.config.reference.markdown() -->"
TRL_MARKER = "<!-- generated: grpo_accel.config.reference.trl_markdown() -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        from grpo_accel.config.reference import markdown as reference

        markdown = markdown.replace(MARKER, reference())
    if TRL_MARKER in markdown:
        from grpo_accel.config.reference import trl_markdown as trl_fields

        markdown = markdown.replace(TRL_MARKER, trl_fields())
    return markdown
