"""Image input for the language models: encoder, image-token layout, reuse rules
(docs/vision.md).  chat/images.py parses and refuses request image parts; this package
turns accepted images into image-token blocks and their embedding rows."""
