"""bench comm and bench train: the collectives measured, and braidtrain against torch and transformers yardsticks."""
