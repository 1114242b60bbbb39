"""A replica: its model as one flat buffer, its optimizer, its data, its examples and its learnable values."""
