"""Tool calling: parsers of model-written calls (registry), the per-choice extractor, the tool-aware chat template."""

from pdserve.runtime.tool_calling.extractor import ToolCallExtractor, new_call_id
from pdserve.runtime.tool_calling.parsers import TOOL_PARSERS, ToolParser, create_tool_parser

__all__ = ["TOOL_PARSERS", "ToolCallExtractor", "ToolParser", "create_tool_parser", "new_call_id"]
