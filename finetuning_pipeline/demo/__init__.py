"""The embedded demo: a tiny Mistral and its tokenizer, pretrained on the bundled text, and the demo's inputs."""
