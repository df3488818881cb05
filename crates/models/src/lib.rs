//! arfuse-models: builds the tensor-parallel decoder graph a serving engine runs from a Hugging Face config.json.
