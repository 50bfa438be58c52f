"""mkdocs hook: the configuration reference page is rendered from the schema at build time
(grpo_accel.recipe.reference, the same text ``grpo-accel train --help`` prints), so it cannot drift."""
MARKER = "<!-- generated: grpo_accel.recipe.reference.markdown() -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from grpo_accel.recipe.reference import markdown as reference

    return markdown.replace(MARKER, reference())
