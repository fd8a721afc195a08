"""Sphinx configuration of the user guide (``make docs``; built with warnings as errors,
broken links included, by ``make test``). The pages are Markdown, read by MyST."""

project = "checkpointless"
author = "the checkpointless developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 4  # links to a heading: page.md#its-slug
# Pages written before the site have headings that skip a level; links, the point of
# the strict build, stay checked.
suppress_warnings = ["myst.header"]
html_theme = "alabaster"
html_title = "checkpointless"
html_theme_options = {"nosidebar": False, "page_width": "1100px", "body_max_width": "none"}
html_show_sourcelink = False
