"""DeepSeek V4 chat protocol: prompt template, DSML tool-call syntax, streaming output parser."""
