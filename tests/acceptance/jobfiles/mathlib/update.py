def descend(weights, gradient, step_size):
    return weights - step_size * gradient
