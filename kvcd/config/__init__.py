"""Instance configuration: files -> frozen dataclasses, validated. Reads files; runs nothing."""
