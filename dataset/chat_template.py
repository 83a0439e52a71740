"""The built-in chat template: ChatML, used when a tokenizer brings no template of its own.

Rendered conversation (one line per piece):
    <s><|im_start|>system\n{content}<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}<|im_end|>\n
`<|im_end|>` closes every turn; the one closing an assistant turn is what teaches the model
to stop, so it is trained on (kept in the loss) along with the assistant's content.
With `add_generation_prompt=True` the text ends in "<|im_start|>assistant\n".
"""

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
