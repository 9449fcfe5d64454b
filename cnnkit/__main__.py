from cnnkit.cli import main

main()
