from braidtrain.cli import run

run()
