"""What differs between images and text: data, models, metrics."""
